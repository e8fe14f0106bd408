"""CudaDriver placeholder until the CUDA VMM implementation lands."""

from .errors import DriverUnavailableError


class CudaDriver:
    def __init__(self, *args, **kwargs) -> None:
        raise DriverUnavailableError("CudaDriver is not implemented yet")
