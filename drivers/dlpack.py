"""Zero-copy torch tensors over a raw address through a DLPack capsule built with ctypes.

Why not `torch.as_tensor(obj_with___cuda_array_interface__)`: torch asks the CUDA runtime
what the pointer is (cudaPointerGetAttributes), and a reserved but unmapped virtual range is
not registered memory, so the call fails ("pointer resides on host memory") for a view made
before its pages are mapped, which is exactly when a vattention cache makes its views. A
DLPack capsule names the device itself (kDLCUDA, ordinal), so torch builds the tensor on that
device without looking at the pointer. Nothing is copied or touched.

The capsule's DLManagedTensor must outlive the tensor (torch calls its deleter when the
storage dies), so each one is kept in `_LIVE` until its deleter runs.
"""

from __future__ import annotations

import ctypes
import threading

import torch

KDL_CPU = 1
KDL_CUDA = 2
_KDL_UINT = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_LIVE: dict[int, tuple[DLManagedTensor, ctypes.Array]] = {}
_LIVE_LOCK = threading.Lock()


@_Deleter
def _delete(managed: ctypes._Pointer) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(ctypes.addressof(managed.contents), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def byte_capsule(ptr: int, nbytes: int, device_type: int, device_id: int) -> tuple[object, int]:
    """A "dltensor" capsule describing nbytes uint8 at ptr on (device_type, device_id), and the
    key its DLManagedTensor is kept under until torch's deleter call."""
    if ptr <= 0 or nbytes <= 0:
        raise ValueError(f"need a non-null pointer and a positive size, got {ptr:#x} and {nbytes}")
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = DLManagedTensor()
    managed.dl_tensor.data = ptr
    managed.dl_tensor.device = DLDevice(device_type, device_id)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None  # compact
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _delete
    key = ctypes.addressof(managed)
    with _LIVE_LOCK:
        _LIVE[key] = (managed, shape)
    return _capsule_new(key, b"dltensor", None), key


def live_capsules() -> int:
    """How many capsules' tensors torch still holds (tests check that none leak)."""
    with _LIVE_LOCK:
        return len(_LIVE)


def byte_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of nbytes at ptr on `device` (cpu or cuda:N); no pointer query, no copy."""
    if device.type == "cuda":
        kind, index = KDL_CUDA, device.index if device.index is not None else 0
    elif device.type == "cpu":
        kind, index = KDL_CPU, 0
    else:
        raise ValueError(f"no DLPack view for device {device}")
    capsule, key = byte_capsule(ptr, nbytes, kind, index)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _LIVE_LOCK:  # torch did not take it, so its deleter will never run
            _LIVE.pop(key, None)
        raise
