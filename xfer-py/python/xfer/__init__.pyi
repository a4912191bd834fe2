"""Type stubs of the xfer package (see the module docstring of xfer/__init__.py)."""

import os
from collections.abc import Awaitable, Generator, Sequence
from types import TracebackType
from typing import Any, Literal

__version__: str

Pages = Sequence[int] | Any  # a list of ints or a 1-D int64 numpy array

class Error(Exception):
    """Base class of every error xfer raises."""

class TimedOut(Error):
    """A wait or a transfer ran out of time; a wait that timed out ends only the wait."""

class PeerStalled(TimedOut):
    """A transfer made no progress for the agent's stall_timeout while its peer's connection
    stands (a stopped or descheduled process); the transfer goes on: wait again or cancel."""

class PeerUnreachable(Error):
    """The peer does not answer or its connection broke (retryable)."""

class PeerRemoved(Error):
    """The peer was removed while the transfer was pending."""

class RemoteKeyInvalid(Error):
    """The target knows no region with this descriptor's key (never registered, or closed)."""

class OutOfBounds(Error):
    """A range falls outside the target's region."""

class PermissionDenied(Error):
    """The target region was not registered with remote_write=True."""

class InvalidArgument(Error):
    """An argument is wrong; the message names the fix."""

class Cancelled(Error):
    """The transfer was cancelled (the agent shut down)."""

class ForeignHandle(InvalidArgument):
    """A Peer or Region of another agent was given to this one."""

class RegionInvalidated(InvalidArgument):
    """The registered torch tensor's storage was resized or replaced after registration
    (resize_ reallocates it), so the memory registered may have been freed: register the
    tensor again. Raised by the next local use of the registration (a transfer, a push or
    pull, close: which closes all the same)."""

class AgentClosed(Error):
    """The agent is closed (or its workers stopped)."""

EngineClosed = AgentClosed
"""Deprecated: the old name of AgentClosed (the same class; xfer.EngineClosed warns
DeprecationWarning)."""

class RegionInUse(Error):
    """The region cannot be closed yet: transfers that use it have not finished."""

class Unsupported(Error):
    """This build, transport or machine cannot do what was asked."""

class TransportFailed(Error):
    """The transport failed in its own way (OS, provider or device error)."""

class Region:
    """Memory registered with an agent (Rust's xfer::Region); the object stays alive until
    close() (a torch tensor's storage too: resizing it makes the next use raise
    RegionInvalidated)."""

    @property
    def descriptor(self) -> bytes:
        """What a peer needs to reach this memory (the library's region descriptor, with its
        keys on every transport of the agent): send it to the peer."""
    @property
    def obj(self) -> Any:
        """The registered object."""
    @property
    def nbytes(self) -> int:
        """Length of the registered memory in bytes."""
    @property
    def is_cuda(self) -> bool:
        """Whether this is CUDA device memory."""
    @property
    def closed(self) -> bool:
        """Whether the region is closed."""
    def close(self) -> None:
        """Deregisters and lets go of the object; RegionInUse while transfers use it.

        A torch tensor whose storage was resized since it was registered is closed all the
        same, then RegionInvalidated is raised (transfers may have used freed memory)."""
    def __enter__(self) -> Region: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

Registration = Region
"""Deprecated: the old name of Region (xfer.Registration warns DeprecationWarning)."""

class Notification:
    """Arrivals of a peer's immediate data (Rust's xfer::Notification): its immediate value,
    how many, who sent them, and the message they carried."""

    @property
    def sender(self) -> str | None:
        """The sending agent's name, where this agent knows it (connect, know)."""
    @property
    def imm(self) -> int:
        """The 32-bit immediate value."""
    @property
    def value(self) -> int:
        """Deprecated: the old name of imm (warns DeprecationWarning)."""
    @property
    def count(self) -> int:
        """How many arrivals of this sender and value (1 from next_notification)."""
    @property
    def message(self) -> bytes | None:
        """The bytes the sender attached (write(..., message=...)), or None."""

class Peer:
    """A peer of an agent (Rust's xfer::Peer), from Agent.connect, reached over one
    transport."""

    @property
    def removed(self) -> bool:
        """Whether the peer was removed."""
    @property
    def transport(self) -> Literal["tcp", "cuda-ipc", "efa", "mem"]:
        """The transport this peer is reached by: the best that both agents offer
        (cuda-ipc between GPU memory of one host, efa, tcp)."""
    @property
    def name(self) -> str:
        """The peer's name, as its info says."""

class Server:
    """A direct-rendezvous server of an agent, from Agent.serve."""

    @property
    def address(self) -> str:
        """Where it listens, "IP:PORT"."""
    def stop(self) -> None:
        """Stops accepting; clients already served keep their connections."""

class Handle:
    """A submitted transfer (Rust's xfer::Handle): wait(), done(), or await it."""

    def wait(self, timeout: float | None = None) -> int:
        """Blocks (GIL released) until the transfer finishes; returns the bytes moved."""
    def done(self) -> bool:
        """Whether the transfer has finished (either way); never blocks."""
    def exception(self) -> Error | None:
        """The transfer's error if it finished and failed, else None."""
    def __await__(self) -> Generator[Any, None, int]: ...

class Agent:
    """An agent of the xfer library (Rust's xfer::Agent): it registers memory (Region),
    connects to peers (Peer) and moves bytes between them (Handle). Keyword arguments
    mirror the xfer command's flags. xfer.Engine is its old name (deprecated).

    transport="auto" (the default) offers every transport that can work here and picks,
    for each peer, the best that both agents offer (Peer.transport): cuda-ipc between GPU
    memory of one host, efa where the placement plan gives EFA NICs, tcp otherwise. So two
    GPU hosts reach each other over tcp, and two GPU processes of one host over cuda-ipc.
    nics="auto" (the default) takes the placement plan's NICs (none on loopback); rails
    defaults to one per NIC chosen, else 1. pin="auto" pins workers to the placement plan's
    cores (those of its first worker, whatever the gpu: several agents on one host would
    share them, hence pin="off" by default).

    auth_token (or auth_token_file, a file holding it, read once at the start: not in
    /proc for other users to read) is a secret tcp peers must know. Without one, an agent
    whose tcp rails listen beyond loopback warns (UserWarning), or with require_auth=True
    refuses to start (InvalidArgument).
    """

    def __init__(
        self,
        transport: Literal["auto", "tcp", "cuda-ipc", "mem", "efa"] = "auto",
        provider: str | None = None,
        rails: int | None = None,
        nics: Literal["auto"] | Sequence[str] | None = "auto",
        memory: Literal["host", "cuda"] = "host",
        gpu: int = 0,
        auth_token: str | None = None,
        timeout: float = 10.0,
        listen: str = "127.0.0.1",
        wait_spin_us: int | None = None,
        pin: Literal["auto", "off"] = "off",
        tcp_congestion: str = "auto",
        name: str | None = None,
        stall_timeout: float | None = None,
        auth_token_file: str | os.PathLike[str] | None = None,
        require_auth: bool = False,
        liveness_timeout: float | None = None,
    ) -> None: ...
    @property
    def info(self) -> bytes:
        """This agent's info (the library's AgentInfo as bytes: every transport it offers,
        with its rails' addresses): give it to peers, who pass it to connect."""
    @property
    def address(self) -> bytes:
        """Deprecated: the old name of info (warns DeprecationWarning)."""
    @property
    def transport(self) -> Literal["auto", "tcp", "cuda-ipc", "mem", "efa"]:
        """The transport's name when the agent offers exactly one, else "auto"."""
    @property
    def name(self) -> str:
        """The agent's name: what peers see, and the name Directory.join publishes."""
    @property
    def transports(self) -> list[str]:
        """The transports the agent offers, in the order they are preferred."""
    @property
    def rails(self) -> int:
        """The number of rails of each transport (the largest, where they differ)."""
    @property
    def closed(self) -> bool:
        """Whether the agent is closed."""
    def register(
        self, obj: Any, remote_write: bool = True, remote_read: bool = False
    ) -> Region:
        """Registers a buffer-protocol object, a CUDA tensor or a DLPack tensor.

        Read-only memory (bytes, a read-only memoryview, a numpy array with
        writeable=False, a __cuda_array_interface__ or DLPack 1.x export marked read-only)
        with remote_write=True raises InvalidArgument; remote_write=False (a source only,
        remote_read=True for peers' reads) takes it.

        A torch tensor: its storage is held with the region, so set_() or del of the
        tensor leaves the registered memory valid. resize_() that outgrows the storage
        reallocates it (torch cannot make a storage non-resizable): the next local use of
        the region (a transfer, a push or pull, close) raises RegionInvalidated. A
        peer's write that lands before that, into memory that was freed, cannot be caught:
        do not resize a registered tensor."""
    def connect(self, info: bytes) -> Peer:
        """Connects to a peer by its Agent.info, over the best transport both offer.

        Bytes that are not an agent's info raise InvalidArgument naming what is wrong."""
    def add_peer(self, address: bytes) -> Peer:
        """Deprecated: the old name of connect (warns DeprecationWarning)."""
    def offer(self, name: str, registration: Region) -> None:
        """Offers an open region to peers under `name` (serve/rendezvous, directory)."""
    def serve(self, listen: str = "127.0.0.1:0", auth_token: str | None = None) -> Server:
        """Serves the direct rendezvous on `listen` ("IP:PORT", port 0 picks one) until
        Server.stop() or close()."""
    def rendezvous(
        self, address: str, auth_token: str | None = None, timeout: float = 20.0
    ) -> tuple[Peer, dict[str, bytes]]:
        """Connects to the agent serving at `address`; returns the peer and the regions it
        offers, name -> descriptor bytes."""
    def remove_peer(self, peer: Peer) -> None:
        """Removes a peer; its pending transfers fail with PeerRemoved."""
    def write(
        self,
        peer: Peer,
        registration: Region,
        remote_descriptor: bytes,
        segments: Sequence[tuple[int, int, int]] | Any,  # or an (n, 3) int64 numpy array
        imm: int | None = None,
        timeout: float | None = None,
        stream: Any = None,
        message: bytes | None = None,
    ) -> Handle:
        """Writes (src_offset, dst_offset, length) ranges into the peer's region.

        GPU memory is read only after the work queued so far on `stream` (a
        torch.cuda.Stream, cupy.cuda.Stream or int handle; default: torch's current stream
        for a torch tensor, else the __cuda_array_interface__ stream, else the legacy
        default stream) has run."""
    def write_pages(
        self,
        peer: Peer,
        registration: Region,
        remote_descriptor: bytes,
        src_pages: Pages,
        dst_pages: Pages,
        page_size: int,
        src_stride: int | None = None,
        dst_stride: int | None = None,
        imm: int | None = None,
        timeout: float | None = None,
        stream: Any = None,
        message: bytes | None = None,
    ) -> Handle:
        """Writes local page src_pages[i] to the peer's page dst_pages[i] (stream: as write)."""
    def read(
        self,
        peer: Peer,
        registration: Region,
        remote_descriptor: bytes,
        segments: Sequence[tuple[int, int, int]] | Any,  # or an (n, 3) int64 numpy array
        timeout: float | None = None,
        stream: Any = None,
        message: bytes | None = None,
        imm: int | None = None,
    ) -> Handle:
        """Reads (local_offset, remote_offset, length) ranges of the peer's region.

        GPU memory is written only after the work queued so far on `stream` has run (see
        write)."""
    def read_pages(
        self,
        peer: Peer,
        registration: Region,
        remote_descriptor: bytes,
        local_pages: Pages,
        remote_pages: Pages,
        page_size: int,
        local_stride: int | None = None,
        remote_stride: int | None = None,
        timeout: float | None = None,
        stream: Any = None,
        message: bytes | None = None,
        imm: int | None = None,
    ) -> Handle:
        """Reads the peer's remote_pages[i] into local page local_pages[i] (stream: as read)."""
    def wait_imm(self, value: int, count: int = 1, timeout: float | None = None) -> None:
        """Blocks until `count` transfers with immediate `value` have landed here."""
    def next_notification(self, timeout: float | None = None) -> Notification:
        """The next arrival of a peer's immediate data (one), oldest first; TimedOut after
        `timeout`. Arrivals are never dropped; every way of taking them shares one store."""
    def next_notification_async(
        self, timeout: float | None = None
    ) -> Awaitable[Notification]:
        """next_notification for asyncio (call from a running event loop)."""
    def notifications(self) -> list[Notification]:
        """Every arrival not yet taken, each sender and value once with its count."""
    def know(self, address: bytes) -> None:
        """Names a peer's notifications (address: its Agent.info) without connecting to it
        (connect does too)."""
    def metrics(self) -> str:
        """The agent's figures in the Prometheus text exposition format (xfer serve's names)."""
    def counters(self) -> dict[str, int]:
        """Sums of the rails' counters."""
    def close(self) -> None:
        """Stops the agent and gives back every region's memory.

        Memory a transport that did not stop in time still holds stays alive, with a
        ResourceWarning, until the transport lets go (or for the rest of the process)."""
    def __enter__(self) -> Agent: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

Engine = Agent
"""Deprecated: the old name of Agent (xfer.Engine warns DeprecationWarning)."""

class DirectoryError(Error):
    """The cluster directory failed: etcd unreachable, a bad URL, a record refused."""

class Publication:
    """A published record; withdraw() removes it (a dead process's goes after its ttl)."""
    def withdraw(self) -> None: ...
    def update(self) -> None:
        """Publishes a joined agent again with what it offers now (Directory.join only)."""

class Following:
    """A cluster followed by an agent (Directory.follow): members are connected as they
    join and disconnected as they leave; weight-sync members refresh against it."""
    def peers(self) -> list[str]:
        """The names of the members connected now."""
    def close(self) -> None:
        """Stops following; the peers stay connected."""

class Watch:
    """A cluster's changes in order: every member now as "joined", then each change."""
    def next(self, timeout: float = 1.0) -> tuple[str, dict[str, Any]] | None:
        """("joined" | "updated" | "left", member), or None after `timeout` seconds."""

class Directory:
    """A cluster directory: etcd://HOST:PORT[,HOST:PORT...] or file://PATH.

    Members are dicts: name, address (the member's Agent.info: bytes for Agent.connect),
    regions (name -> descriptor bytes), transport, host, memory, gpu, nics, control,
    instance, age_s.
    """
    def __init__(self, url: str, cluster: str = "default") -> None: ...
    def publish(
        self,
        name: str,
        agent: Agent,
        regions: dict[str, Region] | None = None,
        ttl: float = 10.0,
    ) -> Publication: ...
    def join(self, agent: Agent, ttl: float = 10.0) -> Publication:
        """Publishes `agent` under its own name with every region it offers now."""
    def follow(self, agent: Agent) -> Following:
        """Connects `agent` to every other member as it joins (the members now
        first)."""
    def lookup(self, name: str) -> dict[str, Any] | None: ...
    def members(self) -> list[dict[str, Any]]: ...
    def watch(self) -> Watch: ...
