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

Besides the faults it injects, the proxy keeps the fate of every claim answer
that carries jobs, so the harness can hold the worker's claim counter to the
audit trail job by job: :attr:`PgProxy.answered` (forwarded whole to a client
that went on with it), :attr:`PgProxy.cuts` (armed cuts), :attr:`PgProxy.lost`
(committed, but the worker never took the answer: it had given up on the
statement, at its client-side deadline, before the answer reached it) and
:attr:`PgProxy.unsure` (the server's connection broke in mid-answer: committed
or not, only the audit trail knows). A worker that gives up on a statement in
flight tells the server so: the driver sends a CancelRequest (with the
session's backend key) on a new connection, and then still reads, and throws
away, whatever answer arrives within its cancel wait. The proxy reads every
CancelRequest as it arrives, so a claim answer held past the deadline (by a
half-open hold) and forwarded afterwards, or forwarded just as the deadline
fired, is known to be lost, not answered.

Only what the harness needs is parsed: Parse / Bind / Query / Sync and
CancelRequest from the client, BackendKeyData / DataRow / ErrorResponse /
ReadyForQuery from the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import uuid
from dataclasses import dataclass, field

#: A claim locks its candidates and draws a fresh token (a worker's claim writes its tag
#: into the token's tail: ``overlay(gen_random_uuid()::text …)``); recovery, pruning and
#: enqueueing each have one of the two, never both.
CLAIM_MARKERS = (b"FOR UPDATE SKIP LOCKED", b"gen_random_uuid()")
# An ack or a reschedule: both record the attempt's token as last_token.
WRITE_MARKERS = (b"last_token = a.token", b"last_token = r.token")
NEGOTIATION_CODES = {80877103, 80877104}  # SSLRequest, GSSENCRequest
CANCEL_REQUEST_CODE = 80877102
#: How long a claim answer still on its way is read after its client has gone.
CLIENT_GONE_READ_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class CutRow:
    """One job whose claim committed but whose answer the worker never saw."""

    job_id: str
    order_id: str
    token: str
    attempt: int


@dataclass(slots=True)
class Cut:
    """One claim answer the worker never took: when, its claimed rows, and why.

    *why*: ``armed`` (a claim_cut fault), ``client gone`` (the client closed
    while the answer was held), ``cancelled`` (the client cancelled the
    statement, at its deadline, before it had taken the answer) or ``broken``
    (the server's side closed in mid-answer: committed or not).
    """

    at: float
    rows: list[CutRow]
    why: str = "armed"


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
    key: bytes = b""  # BackendKeyData (pid + secret), what a CancelRequest names
    #: The last answer was forwarded up to its ReadyForQuery and the client has
    #: sent nothing since: a CancelRequest now is for that answer.
    answered: bool = False
    #: The claimed rows of that last answer, when it was a claim.
    last_claim: list[CutRow] = field(default_factory=list)
    #: The client cancelled the statement whose answer is still to come.
    abandoned: bool = False
    #: The client closed while a claim's answer was still on its way.
    client_gone: bool = False


class PgProxy:
    """Forward 127.0.0.1:*port* to the server at *upstream_port*; see the module doc."""

    def __init__(self, upstream_port: int, port: int) -> None:
        self.upstream_port = upstream_port
        self.port = port
        self.cuts: list[Cut] = []  # armed claim cuts
        #: committed claims whose answer the worker never took (see the module doc)
        self.lost: list[Cut] = []
        #: claim answers broken off in mid-answer by the server's side
        self.unsure: list[Cut] = []
        #: rows of claim answers forwarded whole to a client that took them, by token
        self.answered: dict[str, CutRow] = {}
        self.cancels = 0  # CancelRequests seen
        self._sessions: dict[bytes, _Session] = {}  # by backend key
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

    def _lose(self, rows: list[CutRow], why: str) -> None:
        """Record claimed *rows* whose answer the worker never took (see :class:`Cut`)."""
        if not rows:
            return
        for row in rows:
            self.answered.pop(row.token, None)
        (self.unsure if why == "broken" else self.lost).append(Cut(time.time(), list(rows), why))

    def _cancel_requested(self, key: bytes) -> None:
        """The client of the session with backend *key* gave up on its statement in flight.

        Its driver still reads that statement's answer, if one comes within its
        cancel wait, and throws it away: a claim answered now or later is lost.
        """
        self.cancels += 1
        s = self._sessions.get(key)
        if s is None:
            return
        if s.answered:
            # Forwarded whole, but the deadline fired before the client had read it.
            self._lose(s.last_claim, "cancelled")
            s.last_claim = []
        else:
            s.abandoned = True

    @staticmethod
    async def _startup_packet(reader: asyncio.StreamReader) -> bytes:
        """One untyped start-up packet: a negotiation request, a StartupMessage or a
        CancelRequest (length, code, rest)."""
        head = await reader.readexactly(8)
        (length,) = struct.unpack_from("!i", head, 0)
        return head + await reader.readexactly(length - 8)

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        session = _Session()
        try:
            # Read before anything else (and before any hold): a CancelRequest says
            # the client has given up on a statement, whether or not it goes through.
            try:
                first = await self._startup_packet(creader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if struct.unpack_from("!i", first, 4)[0] == CANCEL_REQUEST_CODE:
                self._cancel_requested(first[8:])
            try:
                sreader, swriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            except OSError:
                return
            pumps = [
                asyncio.create_task(self._client_to_server(creader, swriter, session, first)),
                asyncio.create_task(self._server_to_client(sreader, cwriter, session)),
            ]
            try:
                done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                if pumps[1] not in done and session.claim_answer:
                    # The client left with a claim on its way to the server: read
                    # its answer, to know what it committed, instead of dropping it.
                    session.client_gone = True
                    await asyncio.wait([pumps[1]], timeout=CLIENT_GONE_READ_SECONDS)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                with contextlib.suppress(Exception):
                    swriter.transport.abort()
        finally:
            with contextlib.suppress(Exception):
                cwriter.transport.abort()
            if session.key and self._sessions.get(session.key) is session:
                del self._sessions[session.key]
            self._tasks.discard(task)

    async def _client_to_server(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter, s: _Session, first: bytes) -> None:
        # Untyped start-up phase: negotiation requests, then the StartupMessage (or
        # a CancelRequest); *first* was read by _accept.
        packet = first
        while True:
            await self._held()
            writer.write(packet)
            if struct.unpack_from("!i", packet, 4)[0] not in NEGOTIATION_CODES:
                break
            packet = await self._startup_packet(reader)
        while True:
            kind = await reader.readexactly(1)
            (length,) = struct.unpack("!i", await reader.readexactly(4))
            body = await reader.readexactly(length - 4)
            # The client sends nothing before it has read the last answer whole.
            s.answered, s.last_claim = False, []
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
            try:
                kind = await reader.readexactly(1)
                raw_len = await reader.readexactly(4)
                (length,) = struct.unpack("!i", raw_len)
                body = await reader.readexactly(length - 4)
            except (asyncio.IncompleteReadError, ConnectionError):
                if s.claim_answer:  # broken off before its ReadyForQuery: committed or not
                    self._lose(rows, "broken")
                raise
            message = kind + raw_len + body
            if kind == b"K":  # BackendKeyData: what a CancelRequest for this session names
                s.key = body
                self._sessions[body] = s
            if not s.claim_answer:
                await self._held()
            if s.cutting_write:
                held.append(message)
                if kind == b"D":
                    rows.append(CutRow("", "", "", 0))
                elif kind == b"E":
                    rows = []  # rolled back: there is no committed write to cut
                elif kind == b"Z":
                    s.cutting_write = False
                    if rows and self._writes_to_cut > 0:
                        self._writes_to_cut -= 1
                        self.write_cuts.append(time.time())
                        return  # committed; the worker never hears of it
                    for m in held:
                        writer.write(m)
                    s.answered, s.abandoned, s.last_claim = True, False, []
                    await writer.drain()
                    held, rows = [], []
                continue
            if not s.claim_answer:
                writer.write(message)
                if kind == b"Z":
                    s.answered, s.abandoned, s.last_claim = True, False, []
                await writer.drain()
                continue
            # A claim's whole answer is read before any of it is forwarded: an armed
            # cut drops it, and a hold (half-open) that outlives the worker's patience
            # drops it as a whole. A claim answers one row even when it claimed
            # nothing (the flow state, job columns NULL): count only rows that carry
            # a job; an error rolls the claim back, so it claimed nothing.
            held.append(message)
            if kind == b"D":
                cols = _data_row(body)
                if cols[0] is not None:
                    rows.append(CutRow(_text(cols[0]), _text(cols[1]), _text(cols[2]),
                                       _attempt(cols[3])))
            elif kind == b"E":
                rows = []
            if kind != b"Z":
                continue
            s.claim_answer = False
            if s.cutting:
                s.cutting = False
                if rows and self._to_cut > 0:
                    self._to_cut -= 1
                    self.cuts.append(Cut(time.time(), rows))
                    return  # drop: the worker never sees the committed claim
            if s.client_gone:
                self._lose(rows, "client gone")
                return
            s.claim_rows = len(rows)
            self.claims_with_rows += bool(rows)
            if rows and self._stall_armed:
                self._start_stall()
            try:
                await self._held()
            except asyncio.CancelledError:
                self._lose(rows, "client gone")  # the worker gave up on a claim that committed
                raise
            for m in held:
                writer.write(m)
            if s.abandoned:  # the client cancelled it: its driver reads this and drops it
                self._lose(rows, "cancelled")
                rows = []
            for row in rows:
                self.answered[row.token] = row
            s.answered, s.abandoned, s.last_claim = True, False, rows
            await writer.drain()
            held, rows = [], []
