"""Type stub of the native extension (csrc/bindings.cpp): transfer buffers, transports, the writer.

Every blocking call releases the GIL. A non-OK status raises the matching p2pweights.errors class.
"""
from __future__ import annotations

import enum
from typing import Any, Protocol, TypedDict

import numpy as np
import numpy.typing as npt

__version__: str
#: NIXL wheel versions whose C API csrc/transport/nixl_capi.h was checked against (others: Python API)
NIXL_CAPI_CHECKED_VERSIONS: tuple[str, ...]

class Code(enum.IntEnum):
    IN_PROGRESS = 1
    OK = 0
    INVALID_ARGUMENT = -1
    TIMEOUT = -2
    REMOTE_DISCONNECTED = -3
    TRANSPORT_ERROR = -4
    CLOSED = -5
    NOT_FOUND = -6
    BUSY = -7
    OUT_OF_REGION = -8
    DEVICE_ERROR = -9  # a CUDA driver/runtime call failed (errors.DeviceError)
    FENCED = -10  # a write refused before posting: the session's lease ended (errors.Fenced)

class CudaRuntimeInfo(TypedDict):
    loaded: bool
    library: str
    device_count: int

def cuda_runtime_info() -> CudaRuntimeInfo: ...

class CudaDriverInfo(TypedDict):
    loaded: bool
    lanes: bool  # cuStreamCreate / cuEventCreate / cuEventRecord / cuStreamWaitEvent found
    kernel: bool  # the batched copy kernel is embedded and cuModuleLoadData / cuLaunchKernel found
    library: str
    error: str

def cuda_driver_info() -> CudaDriverInfo: ...

# Copy programs (csrc/buffers/copy_program.h; copyplans/replay.py): an (n, 7) int64 array of 2-D
# byte copies, checked against slot_bytes and each input's bytes before anything is written.
# Return (code, message) / (code, message, driver calls); code 0 is OK (csrc/status.h).
# check_copy_program: the same bounds, and that no two descriptors write one destination byte
# (OUT_OF_REGION naming both); run where a program is compiled or loaded, not on every replay.
def check_copy_program(program: npt.NDArray[np.int64], dst_bytes: int, input_nbytes: list[int]) -> tuple[int, str]: ...
def run_copy_program_host(program: npt.NDArray[np.int64], slot: int, slot_bytes: int, input_addrs: list[int],
                          input_nbytes: list[int], threads: int = 1) -> tuple[int, str]: ...
def run_copy_program_cuda(program: npt.NDArray[np.int64], slot: int, slot_bytes: int, input_addrs: list[int],
                          input_nbytes: list[int], stream: int, mode: str = "each",
                          lanes: int = 1) -> tuple[int, str, int]: ...  # mode: "kernel" | "each"

# Delta records (csrc/buffers/delta_codec.h; p2pweights/deltas): raw host addresses, the GIL released.
# delta_encode -> (code, message, encoded_bytes, changed_bytes, runs, mode "empty" | "runs" | "dense")
def delta_encode(cur_addr: int, base_addr: int, nbytes: int, unit: int, out_addr: int, out_cap: int,
                 update_base: bool = False, threads: int = 1) -> tuple[int, str, int, int, int, str]: ...
def delta_max_encoded(nbytes: int) -> int: ...
def delta_check(rec_addr: int, rec_len: int, dst_nbytes: int) -> tuple[int, str]: ...
def delta_apply(rec_addr: int, rec_len: int, dst_addr: int, dst_nbytes: int) -> tuple[int, str]: ...
def delta_hash(addr: int, nbytes: int, seed: int = 0) -> int: ...

# GPU delta kernels (csrc/buffers/delta_find.h; deltas/kernels.py): device addresses and a CUstream
# handle; each returns (code, message) once its launch is enqueued.
DELTA_BLOCK_BYTES: int
DELTA_GROUPS_PER_BLOCK: int
def delta_kernels_embedded() -> bool: ...
def delta_find_count(spans: int, n_spans: int, unit: int, mask: int, counts: int, blocks: int,
                     stream: int) -> tuple[int, str]: ...
def delta_find_gather(spans: int, n_spans: int, unit: int, mask: int, ends: int, positions: int, values: int,
                      blocks: int, stream: int) -> tuple[int, str]: ...
def payload_checksum(words: int, n_words: int, out: int, stream: int) -> tuple[int, str]: ...
# An area's index records checked, then applied, one launch each (csrc/buffers/delta_apply_gpu.h;
# deltas/index_apply.py): records = n x int64[8], verdicts = n x uint64[2], rows = int64[3] each.
DELTA_CHECK_WORDS: int
DELTA_APPLY_ELEMENTS: int
def delta_apply_kernels_embedded() -> bool: ...
def delta_records_check(records: int, n_records: int, verdicts: int, blocks: int, stream: int) -> tuple[int, str]: ...
def delta_records_apply(records: int, n_records: int, rows: int, blocks: int, stream: int) -> tuple[int, str]: ...

class SlotView:
    """The buffer-protocol exporter behind a slot view; holds the transfer buffer open while alive."""

class TransferBuffer:
    alignment: int  # class attribute (2 MiB)
    @staticmethod
    def allocate(slot_bytes: int, num_slots: int = 2, pin: str = "auto") -> TransferBuffer:
        """InvalidWrite when num_slots x slot_bytes (rounded up to the alignment) does not fit in 64 bits."""
    @staticmethod
    def wrap(addr: int, slot_bytes: int, num_slots: int, location: str = "cpu") -> TransferBuffer:
        """InvalidWrite when the slots would run past 2^64."""
    @property
    def address(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def location(self) -> str: ...
    @property
    def pin_mode(self) -> str: ...  # none | mlock | cuda_host_register | device
    @property
    def pin_warning(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def released(self) -> bool: ...
    @property
    def users(self) -> int: ...
    def slot_address(self, i: int) -> int: ...
    def slot_view(self, i: int) -> memoryview: ...
    def close(self) -> None: ...

class Transport:
    @property
    def name(self) -> str: ...
    def register_memory(self, addr: int, length: int, location: str = "cpu") -> None: ...
    def deregister_memory(self, addr: int) -> None: ...
    def connect(self, engine: int, descriptor: str) -> None: ...
    def disconnect(self, engine: int) -> None: ...
    def close(self) -> None: ...

class LoopbackTransport(Transport):
    def __init__(self) -> None: ...
    def set_fault(self, engine: int, delay_s: float = 0.0, fail_after_bytes: int = -1, hang: bool = False,
                  disconnected: bool = False, link_gbps: float = 0.0) -> None: ...
    def bytes_copied(self, engine: int) -> int: ...

class Backend(Protocol):
    """What PyTransport calls (from the writer's threads, holding the GIL per call)."""

    name: str
    def register_memory(self, addr: int, length: int, location: str) -> Any: ...
    def deregister_memory(self, addr: int) -> Any: ...
    def connect(self, engine: int, descriptor: str) -> Any: ...
    def disconnect(self, engine: int) -> Any: ...
    # -> request id (int >= 0)
    def post(self, engine: int, local: list[int], remote: list[int], lengths: list[int]) -> int: ...
    # -> a Code value, or (code, message) for an error
    def poll(self, request: int) -> int | tuple[int, str]: ...
    # -> None once let go; 1 (IN_PROGRESS) while a write it could not cancel may still read memory
    def release(self, request: int) -> int | None: ...
    def close(self) -> Any: ...

class PyTransport(Transport):
    def __init__(self, backend: Backend) -> None: ...
    @property
    def backend(self) -> Any: ...

class NixlStats(TypedDict):
    requests_made: int      # NIXL transfer requests created
    requests_reposted: int  # posts that re-used a kept (completed, identical) request
    kept: int               # completed requests kept for re-posting now
    draining: int           # handles NIXL refused to release, retried later

class NixlTransport(Transport):
    """NIXL through its C API, dlopen'ed from ``library``: posted and polled without the GIL.
    ``connect`` refuses (the descriptor is JSON): p2pweights.transport.nixl.NativeNixlTransport
    parses it and calls ``connect_peer``."""
    def __init__(self, library: str, agent_name: str, plugin: str = "UCX", progress_delay_us: int = 1000) -> None: ...
    def connect_peer(self, engine: int, agent_metadata: bytes, location: str = "cpu") -> None: ...
    @property
    def agent_name(self) -> str: ...
    @property
    def plugin(self) -> str: ...
    @property
    def library(self) -> str: ...
    def stats(self) -> NixlStats: ...

class EngineReportDict(TypedDict):
    engine: int
    name: str
    bytes: int
    writes: int
    batches: int
    skipped_batches: int
    peak_inflight: int
    seconds: float
    gbps: float
    state: str  # idle | ok | failed
    code: int
    error: str

_IntArray = npt.ArrayLike | np.ndarray

class PipelinedWriter:
    def __init__(self, transport: Transport, buffer: TransferBuffer, transfer_timeout: float = 30.0,
                 max_inflight_batches: int = 2) -> None: ...
    @property
    def transfer_timeout(self) -> float: ...
    def add_engine(self, engine: int, name: str, regions: list[tuple[int, int]]) -> None:
        """InvalidWrite for a region (addr, length) that runs past 2^64."""
    def remove_engine(self, engine: int) -> None: ...
    def fence(self, engine: int, seconds: float) -> None: ...
    def acquire(self, timeout: float = -1.0) -> int: ...
    def release_slot(self, slot: int) -> None: ...
    def submit(self, slot: int, offsets: _IntArray, lengths: _IntArray, engines: _IntArray,
               remote_addrs: _IntArray) -> None:
        """Only from a slot acquire() gave and not yet submitted or released (InvalidWrite names it)."""
    def pending_batches(self, slot: int) -> int: ...
    def draining_batches(self) -> int: ...
    def finish(self) -> list[EngineReportDict]: ...
    def close(self) -> None: ...
