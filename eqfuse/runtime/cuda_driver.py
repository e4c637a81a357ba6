"""The few CUDA driver API calls an exported graph needs, through ctypes on libcuda.

Loading a cubin and launching its kernel takes five driver calls; going through ctypes
keeps Triton (and its compiler, and its C launcher that is built on first use) out of the
process. Modules are loaded into the device's primary context, the one torch uses.
"""

from __future__ import annotations

import ctypes

from ..errors import EqfuseError

CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_FUNC_CACHE_PREFER_SHARED = 1
DEFAULT_SHARED_LIMIT = 49152  # bytes a kernel may use without opting in


class CudaDriverError(EqfuseError):
    """A CUDA driver call failed, or libcuda is not there."""


class Driver:
    """libcuda, with argument types declared once (ctypes converts faster that way)."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaDriverError(f"libcuda.so.1 cannot be loaded ({e}); exported graphs need an NVIDIA "
                                  "driver") from e
        lib = self.lib
        P, U, Int = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        lib.cuInit.argtypes = [U]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(P)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(Int), Int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(P), Int]
        lib.cuCtxSetCurrent.argtypes = [P]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(P), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(P), P, ctypes.c_char_p]
        lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(Int), Int, P]
        lib.cuFuncSetAttribute.argtypes = [P, Int, Int]
        lib.cuFuncSetCacheConfig.argtypes = [P, Int]
        lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(Int), Int, Int]
        lib.cuLaunchKernel.argtypes = [P, U, U, U, U, U, U, U, P, ctypes.POINTER(P), ctypes.POINTER(P)]
        lib.cuGetErrorName.argtypes = [Int, ctypes.POINTER(ctypes.c_char_p)]
        self.launch_kernel = lib.cuLaunchKernel
        # The same entry point without declared types, for arguments that are ctypes objects
        # already (see ExportedGraph): ctypes then passes them without converting each one,
        # which saves a microsecond or two per launch.
        self.launch_prepared = lib["cuLaunchKernel"]

    def check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise CudaDriverError(f"{what} failed: {(name.value or b'CUDA error %d' % result).decode()}")

    def use_primary_context(self, device_index: int) -> None:
        """Make the device's primary context current on this thread, if none is."""
        self.check(self.lib.cuInit(0), "cuInit")
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load_function(self, image: bytes, entry: str, shared: int, device_index: int) -> tuple:
        """(module, function) for ``entry`` in the cubin ``image``; a kernel that uses more than
        48 KB of dynamic shared memory is allowed to (as Triton's own loader does)."""
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, entry.encode()),
                   f"cuModuleGetFunction({entry})")
        if shared > DEFAULT_SHARED_LIMIT:
            optin, static = ctypes.c_int(), ctypes.c_int()
            self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(optin),
                                                     CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                                     device_index), "cuDeviceGetAttribute")
            self.check(self.lib.cuFuncGetAttribute(ctypes.byref(static), CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                                   function), "cuFuncGetAttribute")
            if shared > optin.value - static.value:
                raise CudaDriverError(f"kernel {entry} needs {shared} bytes of shared memory; this device "
                                      f"allows {optin.value - static.value}")
            self.check(self.lib.cuFuncSetCacheConfig(function, CU_FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig")
            self.check(self.lib.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   optin.value - static.value), "cuFuncSetAttribute")
        return module, function

    def function_attribute(self, function, attribute: int) -> int:
        value = ctypes.c_int()
        self.check(self.lib.cuFuncGetAttribute(ctypes.byref(value), attribute, function), "cuFuncGetAttribute")
        return value.value


_driver: Driver | None = None


def driver() -> Driver:
    global _driver
    if _driver is None:
        _driver = Driver()
    return _driver
