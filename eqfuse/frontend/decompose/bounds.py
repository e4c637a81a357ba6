"""The work bound the decompositions share (tests lower it to see the eager step)."""

# Prefix sums as row sums: element i of a cumulative sum is the sum over j of x[j] where j
# <= i, a reduction over a triangle of the row that a kernel reads in place (no n x n
# tensor is stored). Its work is n times the input's, so only inputs whose elements times
# the summed length stay below this take it (RoBERTa's and OPT's position ids, 8 x 512 or 4
# x 1024 tokens; a mixture of experts' counts), the others run ATen's scan in eager.
CUMSUM_WORK = 1 << 24
