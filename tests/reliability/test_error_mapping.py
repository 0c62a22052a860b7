"""The one place exceptions become status codes: running out of memory is RESOURCE_EXHAUSTED, not INTERNAL."""

import grpc

from services.common.rpc.server import status_for


def test_running_out_of_memory_serving_a_request_is_resource_exhausted():
    class OutOfMemoryError(RuntimeError):   # torch.OutOfMemoryError, without importing torch
        pass

    for exc in (MemoryError(), RuntimeError("std::bad_alloc"), OutOfMemoryError("CUDA out of memory. Tried ..."),
                RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")):
        code, message = status_for(exc)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of memory" in message
    assert status_for(RuntimeError("boom"))[0] == grpc.StatusCode.INTERNAL
    assert status_for(ValueError("x: bad"))[0] == grpc.StatusCode.INVALID_ARGUMENT
