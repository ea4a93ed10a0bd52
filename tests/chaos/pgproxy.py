"""A PostgreSQL wire-protocol TCP proxy that can cut a claim's answer or stall.

It sits between one worker and PostgreSQL on 127.0.0.1 and frames both
directions of the protocol (v3) so it knows which statement each answer
belongs to. Two faults, armed from the chaos harness:

* **cut claim** (:meth:`PgProxy.arm_cut`): the next claim statement that
  returns rows is forwarded to the server *including its Sync* (the claim runs
  in autocommit, so the server commits it at Sync), the answer is read from the
  server (so the proxy knows the job ids, tokens and attempts that were
  committed) and, instead of being forwarded, both sockets are closed. The
  worker sees a broken connection with an unknown outcome; by the design's
  rule it must not deliver those jobs. Each cut is recorded in :attr:`cuts`.
* **stall after a claim** (:meth:`PgProxy.arm_stall`): once the next claim
  that returns rows has been answered, hold every client message for a number
  of seconds (a network partition). The worker delivers the jobs it just
  claimed; their acks reach the server after the lease expired and must be
  refused as stale.

* **cut a write** (:meth:`PgProxy.arm_cut_write`): the next ack or reschedule
  that returns rows is forwarded with its Sync (so it commits) and its answer
  dropped with the connection: the worker must find out on a fresh connection
  that its write landed (and count it as such), not call it stale.
* **half-open** (:meth:`PgProxy.hold`): for a number of seconds nothing moves
  in either direction on any connection, new ones included, and nothing is
  closed: no RST, no error, as when a network path silently drops packets.

Only what the harness needs is parsed: Parse / Bind / Query / Sync from the
client, DataRow / ReadyForQuery from the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import uuid
from dataclasses import dataclass, field

CLAIM_MARKERS = (b"FOR UPDATE SKIP LOCKED", b"lease_token = gen_random_uuid()")
# An ack or a reschedule: both record the attempt's token as last_token.
WRITE_MARKERS = (b"last_token = a.token", b"last_token = r.token")
NEGOTIATION_CODES = {80877103, 80877104}  # SSLRequest, GSSENCRequest


@dataclass(frozen=True, slots=True)
class CutRow:
    """One job whose claim committed but whose answer the worker never saw."""

    job_id: str
    order_id: str
    token: str
    attempt: int


@dataclass(slots=True)
class Cut:
    """One cut connection: when, and the claimed rows that were dropped."""

    at: float
    rows: list[CutRow]


def _gone(reader: asyncio.StreamReader) -> bool:
    """The peer has closed its side (EOF received), whatever is still buffered."""
    return bool(getattr(reader, "_eof", False))


def _is_claim(query: bytes) -> bool:
    return all(marker in query for marker in CLAIM_MARKERS)


def _kind(query: bytes) -> str | None:
    """``claim``, ``write`` (ack or reschedule) or None for another statement."""
    if _is_claim(query):
        return "claim"
    if any(marker in query for marker in WRITE_MARKERS):
        return "write"
    return None


def _cstring(buf: bytes, pos: int) -> tuple[bytes, int]:
    end = buf.index(b"\x00", pos)
    return buf[pos:end], end + 1


def _text(value: bytes | None) -> str:
    if value is None:
        return ""
    if len(value) == 16:  # binary uuid
        return str(uuid.UUID(bytes=value))
    return value.decode("utf-8", "replace")


def _attempt(value: bytes | None) -> int:
    if value is None:
        return 0
    if len(value) == 4 and not value.isdigit():  # binary int4
        return int(struct.unpack("!i", value)[0])
    return int(value)


def _data_row(body: bytes) -> list[bytes | None]:
    (ncols,) = struct.unpack_from("!h", body, 0)
    pos, cols = 2, []
    for _ in range(ncols):
        (length,) = struct.unpack_from("!i", body, pos)
        pos += 4
        if length < 0:
            cols.append(None)
        else:
            cols.append(body[pos : pos + length])
            pos += length
    return cols


@dataclass(slots=True)
class _Session:
    """Per-connection protocol state."""

    statements: dict[bytes, str | None] = field(default_factory=dict)  # name -> _kind
    claim_pending: bool = False  # a claim was bound since the last Sync
    write_pending: bool = False  # an ack or reschedule was bound since the last Sync
    cutting_write: bool = False  # the answer being read belongs to an armed write cut
    cutting: bool = False  # the answer being read belongs to an armed cut
    claim_answer: bool = False  # the answer being read belongs to a claim
    claim_rows: int = 0


class PgProxy:
    """Forward 127.0.0.1:*port* to the server at *upstream_port*; see the module doc."""

    def __init__(self, upstream_port: int, port: int) -> None:
        self.upstream_port = upstream_port
        self.port = port
        self.cuts: list[Cut] = []
        self.connections = 0
        self.claims = 0  # claim statements seen
        self.claims_with_rows = 0
        self._to_cut = 0
        self._writes_to_cut = 0
        self.write_cuts: list[float] = []  # wall clock of each cut write answer
        self._hold_until = 0.0
        self.holds: list[tuple[float, float]] = []  # (start, end), wall clock
        self._stall_until = 0.0
        self._stall_armed = 0.0
        self.stalls: list[tuple[float, float]] = []  # (start, end), wall clock
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ control

    def arm_cut(self, count: int = 1) -> None:
        """Cut the answers of the next *count* claims that return rows."""
        self._to_cut += count

    @property
    def armed(self) -> int:
        """Cuts still armed (not yet performed)."""
        return self._to_cut

    def arm_cut_write(self, count: int = 1) -> None:
        """Let the next *count* acks/reschedules that return rows commit, then cut their answer."""
        self._writes_to_cut += count

    @property
    def writes_armed(self) -> int:
        """Write cuts still armed (not yet performed)."""
        return self._writes_to_cut

    def hold(self, seconds: float) -> None:
        """Move nothing on any connection for *seconds*, closing nothing (half-open)."""
        self._hold_until = time.monotonic() + seconds
        now = time.time()
        self.holds.append((now, now + seconds))

    async def _held(self) -> None:
        while (wait := self._hold_until - time.monotonic()) > 0:
            await asyncio.sleep(wait)

    def arm_stall(self, seconds: float) -> None:
        """Hold client→server traffic for *seconds* once the next claim with rows is answered."""
        self._stall_armed = seconds

    @property
    def stall_armed(self) -> bool:
        """True until the armed stall has started."""
        return self._stall_armed > 0

    def _start_stall(self) -> None:
        seconds, self._stall_armed = self._stall_armed, 0.0
        self._stall_until = time.monotonic() + seconds
        now = time.time()
        self.stalls.append((now, now + seconds))

    async def start(self) -> None:
        """Listen on 127.0.0.1:port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---------------------------------------------------------- plumbing

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            sreader, swriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            cwriter.close()
            self._tasks.discard(task)
            return
        session = _Session()
        pumps = [
            asyncio.create_task(self._client_to_server(creader, swriter, session)),
            asyncio.create_task(self._server_to_client(sreader, cwriter, session)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for writer in (cwriter, swriter):
                with contextlib.suppress(Exception):
                    writer.transport.abort()
            self._tasks.discard(task)

    async def _client_to_server(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter, s: _Session) -> None:
        # Untyped start-up phase: negotiation requests, then the StartupMessage.
        while True:
            head = await reader.readexactly(8)
            length, code = struct.unpack("!ii", head)
            rest = await reader.readexactly(length - 8)
            await self._held()
            writer.write(head + rest)
            if code not in NEGOTIATION_CODES:
                break
        while True:
            kind = await reader.readexactly(1)
            (length,) = struct.unpack("!i", await reader.readexactly(4))
            body = await reader.readexactly(length - 4)
            wait = self._stall_until - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._held()
            if _gone(reader):
                # The client gave up and closed while this request was held: a
                # half-open path delivers nothing more. Forwarding it now would
                # run (and commit) a claim whose answer nobody reads, unrecorded.
                return
            if kind == b"P":
                name, pos = _cstring(body, 0)
                query, _ = _cstring(body, pos)
                s.statements[name] = _kind(query)
            elif kind == b"B":
                _portal, pos = _cstring(body, 0)
                name, _ = _cstring(body, pos)
                s.claim_pending = s.statements.get(name) == "claim"
                s.write_pending = s.statements.get(name) == "write"
            elif kind == b"Q":
                s.claim_pending = _kind(body) == "claim"
                s.write_pending = _kind(body) == "write"
            elif kind == b"C" and body[:1] == b"S":  # Close statement
                s.statements.pop(_cstring(body, 1)[0], None)
            if (kind == b"S" or kind == b"Q") and s.claim_pending:
                s.claim_pending = False
                s.cutting = self._to_cut > 0
                s.claim_answer, s.claim_rows = True, 0
                self.claims += 1
            if (kind == b"S" or kind == b"Q") and s.write_pending:
                s.write_pending = False
                s.cutting_write = self._writes_to_cut > 0
            writer.write(kind + struct.pack("!i", length) + body)
            await writer.drain()

    async def _server_to_client(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter, s: _Session) -> None:
        # The answer to an SSL/GSS request is one untyped byte; the DSN of a
        # proxied worker disables both, so the stream is typed from the start.
        held: list[bytes] = []
        rows: list[CutRow] = []
        while True:
            kind = await reader.readexactly(1)
            raw_len = await reader.readexactly(4)
            (length,) = struct.unpack("!i", raw_len)
            body = await reader.readexactly(length - 4)
            message = kind + raw_len + body
            if not s.claim_answer:
                await self._held()
            if s.cutting_write:
                held.append(message)
                if kind == b"D":
                    rows.append(CutRow("", "", "", 0))
                elif kind == b"Z":
                    s.cutting_write = False
                    if rows and self._writes_to_cut > 0:
                        self._writes_to_cut -= 1
                        self.write_cuts.append(time.time())
                        return  # committed; the worker never hears of it
                    for m in held:
                        writer.write(m)
                    await writer.drain()
                    held, rows = [], []
                continue
            if not s.cutting and s.claim_answer:
                # A claim's whole answer is read before any of it is forwarded, so
                # that a hold (half-open) that outlives the worker's patience drops
                # a committed claim as a whole, which is then recorded as a cut.
                # A claim answers one row even when it claimed nothing (the flow
                # state, job columns NULL): count only rows that carry a job.
                held.append(message)
                if kind == b"D":
                    cols = _data_row(body)
                    if cols[0] is not None:
                        rows.append(CutRow(_text(cols[0]), _text(cols[1]), _text(cols[2]),
                                           _attempt(cols[3])))
                if kind != b"Z":
                    continue
                s.claim_answer = False
                s.claim_rows = len(rows)
                self.claims_with_rows += bool(rows)
                if rows and self._stall_armed:
                    self._start_stall()
                try:
                    await self._held()
                except asyncio.CancelledError:
                    if rows:  # the worker gave up on a claim that committed
                        self.cuts.append(Cut(time.time(), rows))
                    raise
                for m in held:
                    writer.write(m)
                await writer.drain()
                held, rows = [], []
                continue
            if not s.cutting:
                writer.write(message)
                await writer.drain()
                continue
            held.append(message)
            if kind == b"D":
                cols = _data_row(body)
                if cols[0] is not None:
                    rows.append(CutRow(_text(cols[0]), _text(cols[1]), _text(cols[2]),
                                       _attempt(cols[3])))
            elif kind == b"Z":
                s.cutting = s.claim_answer = False
                if rows and self._to_cut > 0:
                    self._to_cut -= 1
                    self.cuts.append(Cut(time.time(), rows))
                    return  # drop: the worker never sees the committed claim
                for m in held:  # an empty claim: nothing to cut, pass it on
                    writer.write(m)
                await writer.drain()
                held, rows = [], []
