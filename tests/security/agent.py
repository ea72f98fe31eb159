"""A hand-rolled gpufeed client that the security tests run *as another uid* (under setpriv).

It speaks the wire protocol itself (gRPC with the modules protoc generates from
proto/gpufeed/v1/feed.proto, and the memory socket's frames by hand), so it can do what the
client library never would: keep the token, ask the memory socket again after Detach, map
everything a descriptor allows, never release a slot, dribble bytes, flood Attach.

    python3 agent.py COMMAND 'JSON-ARGS'

Each command prints JSON lines on stdout: {"step": NAME, ...} where it waits for a line on
stdin before going on (the test's cue), and a last line {"result": {...}}. PYTHONPATH must hold
the generated modules (gpufeed/v1/feed_pb2.py).

Datasets: when the protocol has DatasetSpec.handle and MemRequest.open_dataset (docs/SECURITY.md
§2), the agent opens the dataset with its own rights and passes the descriptor, as the client
library does; otherwise it names the path (the protocol before dataset handles).
"""

from __future__ import annotations

import array
import fcntl
import json
import mmap
import os
import select
import socket
import struct
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import grpc

from gpufeed.v1 import feed_pb2 as pb

FEED = "/gpufeed.v1.Feed/"
F_SETSIG = 10  # Linux fcntl: the signal of a lease break (Python's fcntl lacks the name)
ADMIN = "/gpufeed.v1.Admin/"
KINDS = {"tokens": pb.DATASET_KIND_TOKENS, "records": pb.DATASET_KIND_RECORDS,
         "image_folder": pb.DATASET_KIND_IMAGE_FOLDER}
DTYPES = {"uint16": pb.DTYPE_UINT16, "uint32": pb.DTYPE_UINT32, "": pb.DTYPE_UNSPECIFIED}

HAS_HANDLES = ("handle" in pb.DatasetSpec.DESCRIPTOR.fields_by_name
               and "open_dataset" in pb.MemRequest.DESCRIPTOR.fields_by_name)


def emit(obj: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def step(name: str, **data: Any) -> str:
    """Tells the test where we are, then waits for its cue (a line on stdin)."""
    emit({"step": name, **data})
    return sys.stdin.readline().strip()


def code_name(code: int) -> str:
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return str(code)


# ---- the memory socket ----

def mem_path(grpc_socket: str, response: Optional[Any] = None) -> str:
    if response is not None and response.mem_socket:
        return os.path.join(os.path.dirname(grpc_socket), os.path.basename(response.mem_socket))
    base = grpc_socket[:-5] if grpc_socket.endswith(".sock") else grpc_socket
    return base + ".mem.sock"


def recv_exact(conn: socket.socket, n: int, fds: List[int]) -> bytes:
    out = b""
    while len(out) < n:
        data, ancdata, _, _ = conn.recvmsg(n - len(out), socket.CMSG_SPACE(4 * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[:len(payload) - len(payload) % 4])
                fds.extend(a)
        if not data:
            raise ConnectionError("memory socket closed mid-frame")
        out += data
    return out


def mem_call(path: str, request: Any, send_fd: Optional[int] = None,
             timeout: float = 10) -> Tuple[Any, List[int]]:
    """One MemRequest -> (MemResponse, descriptors received)."""
    body = request.SerializeToString()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(path)
        frame = struct.pack("<I", len(body)) + body
        if send_fd is None:
            conn.sendall(frame)
        else:
            conn.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                    array.array("i", [send_fd]))])
        fds: List[int] = []
        (length,) = struct.unpack("<I", recv_exact(conn, 4, fds))
        payload = recv_exact(conn, length, fds) if length else b""
        response = pb.MemResponse()
        response.ParseFromString(payload)
        return response, fds
    finally:
        conn.close()


def open_dataset(grpc_socket: str, path: str, kind: str) -> Tuple[Optional[Any], str, str]:
    """Opens `path` with this uid's rights and trades the descriptor for a dataset handle:
    (handle, "", "") or (None, CODE, message) where CODE is the daemon's, or CLIENT when this
    uid could not open the path; (None, "", "") when the protocol has no handles."""
    if not HAS_HANDLES:
        return None, "", ""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if kind == "image_folder":
        flags |= os.O_DIRECTORY
    try:
        fd = os.open(path, flags)
    except OSError as e:
        return None, "CLIENT", f"open: {e.strerror}"
    try:
        request = pb.MemRequest()
        field = pb.MemRequest.DESCRIPTOR.fields_by_name["open_dataset"]
        if field.type == field.TYPE_MESSAGE:
            request.open_dataset.SetInParent()
        elif field.type == field.TYPE_BOOL:
            request.open_dataset = True
        elif field.type == field.TYPE_STRING:
            request.open_dataset = path
        else:
            setattr(request, "open_dataset", 1)
        response, fds = mem_call(mem_path(grpc_socket), request, send_fd=fd)
        for extra in fds:
            os.close(extra)
        if response.code != 0:
            return None, code_name(response.code), response.message
        return response.dataset_handle, "", ""
    finally:
        os.close(fd)


# ---- gRPC ----

class Client:
    def __init__(self, grpc_socket: str) -> None:
        self.socket = grpc_socket
        self.channel = grpc.insecure_channel(f"unix:{grpc_socket}")

    def unary(self, service: str, method: str, request: Any, response_type: Any,
              timeout: float = 30) -> Any:
        call = self.channel.unary_unary(service + method,
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=response_type.FromString)
        return call(request, timeout=timeout)

    def attach_request(self, a: Dict[str, Any]) -> Tuple[Any, str, str]:
        """(AttachRequest, "", "") from the JSON args (with, where the protocol has them, a
        dataset handle for the dataset opened as this uid), or (None, CODE, message)."""
        r = pb.AttachRequest(job=a.get("job", "agent"), rank=a.get("rank", 0),
                             world_size=a.get("world_size", 1), batch_size=a.get("batch_size", 1),
                             seed=a.get("seed", 0), shuffle=a.get("shuffle", False),
                             drop_last=a.get("drop_last", True), ring_slots=a.get("ring_slots", 2))
        r.dataset.kind = KINDS[a.get("kind", "tokens")]
        r.dataset.path = a["dataset"]
        r.dataset.token_dtype = DTYPES[a.get("token_dtype", "")]
        r.dataset.seq_len = a.get("seq_len", 0)
        r.delivery.kind = pb.DELIVERY_KIND_HOST
        if a.get("stop_epoch"):
            r.stop_epoch = a["stop_epoch"]
        if a.get("by_path"):
            return r, "", ""
        handle, code, message = open_dataset(self.socket, a["dataset"], a.get("kind", "tokens"))
        if code:
            return None, code, message
        if handle is not None:
            field = pb.DatasetSpec.DESCRIPTOR.fields_by_name["handle"]
            if field.type == field.TYPE_BYTES and isinstance(handle, str):
                handle = handle.encode()
            elif field.type == field.TYPE_STRING and isinstance(handle, bytes):
                handle = handle.decode("latin-1")
            r.dataset.handle = handle
        return r, "", ""

    def attach(self, a: Dict[str, Any]) -> Dict[str, Any]:
        request, code, message = self.attach_request(a)
        if request is None:
            return {"ok": False, "code": code, "message": message}
        try:
            response = self.unary(FEED, "Attach", request, pb.AttachResponse)
        except grpc.RpcError as e:
            return {"ok": False, "code": e.code().name, "message": e.details() or ""}
        return {"ok": True, "response": response,
                "ring_bytes": response.ring_slots * response.slot_stride_bytes}

    def detach(self, session_id: int, token: str) -> str:
        try:
            self.unary(FEED, "Detach", pb.DetachRequest(session_id=session_id, token=token),
                       pb.DetachResponse)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


class Stream:
    """An open Stream that never releases anything unless told to."""

    def __init__(self, client: Client, session_id: int, token: str) -> None:
        self.outbox: List[Any] = [pb.StreamRequest(open=pb.StreamOpen(session_id=session_id,
                                                                    token=token))]
        self.cv = threading.Condition()
        self.closed = False
        call = client.channel.stream_stream(FEED + "Stream",
                                            request_serializer=lambda m: m.SerializeToString(),
                                            response_deserializer=pb.StreamResponse.FromString)
        self.batches = 0
        self.end_code = ""
        self.end_message = ""
        self.ended_at: Optional[float] = None
        self.responses = call(self._requests())
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _requests(self) -> Iterator[Any]:
        while True:
            with self.cv:
                while not self.outbox and not self.closed:
                    self.cv.wait(0.2)
                if self.closed:
                    return
                item = self.outbox.pop(0)
            yield item

    def _read(self) -> None:
        try:
            for message in self.responses:
                with self.cv:
                    self.batches += len(message.batches)
                    self.cv.notify_all()
            self.end_code = "OK"
        except grpc.RpcError as e:
            self.end_code, self.end_message = e.code().name, e.details() or ""
        with self.cv:
            self.ended_at = time.monotonic()
            self.cv.notify_all()

    def wait_batches(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cv:
            while self.batches < n and self.ended_at is None and time.monotonic() < deadline:
                self.cv.wait(0.1)
            return self.batches >= n

    def wait_end(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cv:
            while self.ended_at is None and time.monotonic() < deadline:
                self.cv.wait(0.1)
            return self.ended_at is not None

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.responses.cancel()


def map_session(client: Client, response: Any) -> Dict[str, Any]:
    """The memory-socket handshake for a session: what the daemon hands over."""
    r, fds = mem_call(mem_path(client.socket, response),
                      pb.MemRequest(session_id=response.session_id, token=response.token))
    out: Dict[str, Any] = {"code": code_name(r.code), "message": r.message,
                           "map_offset": r.map_offset, "map_bytes": r.map_bytes, "fds": fds}
    if fds:
        st = os.fstat(fds[0])
        out["fd_size"] = st.st_size
    return out


# ---- commands ----

def cmd_mem(a: Dict[str, Any]) -> Dict[str, Any]:
    """Attach a small ring, take what the memory socket hands over, read it for the victim's
    marker and overwrite all of it; Detach; ask again with the old id and token; keep the old
    mapping and look at it again after the victim's next session."""
    client = Client(a["socket"])
    attached = client.attach(a)
    if not attached["ok"]:
        return {"attach": attached}
    response = attached["response"]
    got = map_session(client, response)
    result: Dict[str, Any] = {"ring_bytes": attached["ring_bytes"],
                              "slot_stride_bytes": response.slot_stride_bytes,
                              "ring_slots": response.ring_slots,
                              **{k: v for k, v in got.items() if k != "fds"}}
    if not got["fds"]:
        return result
    fd = got["fds"][0]
    size = got["fd_size"]
    marker = a["marker"].encode()
    writable = True
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        writable = False
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    result["writable"] = writable
    step("mapped", **result)  # the test starts the victim's consumer now
    found = False
    writes = 0
    deadline = time.monotonic() + a.get("write_for_s", 2.0)
    pattern = b"\xa5" * (1 << 20)
    while time.monotonic() < deadline:
        found = found or m.find(marker) >= 0
        if writable:
            for off in range(0, size, len(pattern)):
                n = min(len(pattern), size - off)
                m[off:off + n] = pattern[:n]
            writes += 1
        time.sleep(0.01)
    result.update(found_marker_while_attached=found, overwrite_passes=writes)
    result["detach"] = client.detach(response.session_id, response.token)
    again = map_session(client, response)
    for extra in again["fds"]:
        os.close(extra)
    result["after_detach"] = {k: v for k, v in again.items() if k != "fds"}
    result["after_detach"]["got_fd"] = bool(again["fds"])
    step("detached", **result)  # the test runs the victim's next session now
    result["found_marker_after_detach"] = m.find(marker) >= 0
    m.close()
    os.close(fd)
    return result


def cmd_attach(a: Dict[str, Any]) -> Dict[str, Any]:
    """One Attach (by path with by_path), then Detach. Reports the code and message."""
    client = Client(a["socket"])
    attached = client.attach(a)
    if attached["ok"]:
        r = attached["response"]
        return {"ok": True, "code": "OK", "message": "", "num_samples": r.num_samples,
                "session_id": r.session_id, "detach": client.detach(r.session_id, r.token)}
    return attached


def cmd_sessions(a: Dict[str, Any]) -> Dict[str, Any]:
    """`count` Attaches as fast as they go (all in flight at once), each with its stream open
    when `stream` is set; reports the codes; holds them until the test's cue; then Detaches."""
    client = Client(a["socket"])
    count = a["count"]
    call = client.channel.unary_unary(FEED + "Attach",
                                      request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=pb.AttachResponse.FromString)
    codes: Dict[str, int] = {}
    messages: Dict[str, str] = {}
    attached = []
    started = time.monotonic()
    sent_s = 0.0
    i = 0
    # In rounds: the daemon bounds the dataset handles a uid may hold unattached (64), so take
    # as many as it gives, fire those Attaches all at once, and go on until `count` are sent.
    while i < count:
        requests = []
        while i < count:
            # Distinct job names: one rank of one job each.
            request, code, message = client.attach_request(
                {**a, "job": f"{a.get('job', 'agent')}-{i}" if count > 1 else a.get("job", "agent")})
            if request is None:
                if code == "RESOURCE_EXHAUSTED" and requests:
                    break  # the handle cap: attach these first
                return {"error": f"dataset handle {i}: {code}: {message}"}
            requests.append(request)
            i += 1
        futures = [call.future(r, timeout=60) for r in requests]
        sent_s = time.monotonic() - started
        for f in futures:
            try:
                attached.append(f.result())
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as e:
                codes[e.code().name] = codes.get(e.code().name, 0) + 1
                messages.setdefault(e.code().name, e.details() or "")
    streams = []
    if a.get("stream"):
        for r in attached:
            map_session(client, r)
            streams.append(Stream(client, r.session_id, r.token))
    result = {"codes": codes, "messages": messages, "sent_s": sent_s,
              "done_s": time.monotonic() - started,
              "ring_bytes": [r.ring_slots * r.slot_stride_bytes for r in attached]}
    step("attached", **result)
    for s in streams:
        s.close()
    for r in attached:
        client.detach(r.session_id, r.token)
    return result


def cmd_hold(a: Dict[str, Any]) -> Dict[str, Any]:
    """Attach, map, open the stream, take every batch and release none; wait up to
    `wait_s` for the daemon to end the session."""
    client = Client(a["socket"])
    attached = client.attach(a)
    if not attached["ok"]:
        return {"attach": attached}
    r = attached["response"]
    map_session(client, r)
    stream = Stream(client, r.session_id, r.token)
    full = stream.wait_batches(r.ring_slots, 20)
    held_at = time.monotonic()
    step("holding", batches=stream.batches, ring_slots=r.ring_slots, full=full)
    ended = stream.wait_end(a.get("wait_s", 10))
    result = {"batches": stream.batches, "ring_slots": r.ring_slots, "ended": ended,
              "end_code": stream.end_code, "end_message": stream.end_message,
              "ended_after_s": (stream.ended_at - held_at) if stream.ended_at else None}
    stream.close()
    client.detach(r.session_id, r.token)
    return result


def cmd_dribble(a: Dict[str, Any]) -> Dict[str, Any]:
    """Connects to the memory socket and sends a frame one byte every `interval_s`, for at
    most `max_s`; reports when the daemon cut it off."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(a["mem_socket"])
    body = pb.MemRequest(session_id=1, token="0" * 32).SerializeToString()
    frame = struct.pack("<I", 1000) + body + b"\0" * (1000 - len(body))
    started = time.monotonic()
    step("connected")
    sent = 0
    cut = None
    while time.monotonic() - started < a["max_s"] and sent < len(frame):
        try:
            conn.send(frame[sent:sent + 1])
            sent += 1
        except OSError:
            cut = time.monotonic() - started
            break
        # The daemon closing the connection (or answering) shows as readable.
        ready, _, _ = select.select([conn], [], [], a["interval_s"])
        if ready:
            try:
                conn.recv(4096)
            except OSError:
                pass
            cut = time.monotonic() - started
            break
    conn.close()
    return {"sent_bytes": sent, "cut_after_s": cut}


def cmd_probe(a: Dict[str, Any]) -> Dict[str, Any]:
    """For each session id: the memory socket, GetPosition, Detach and Stream with a guessed
    token. {id: {"mem": [CODE, message], "GetPosition": [...], "Detach": [...], ...}}"""
    client = Client(a["socket"])
    token = a.get("token", "0" * 32)
    out: Dict[str, Any] = {}
    for session_id in a["ids"]:
        r, fds = mem_call(mem_path(client.socket), pb.MemRequest(session_id=session_id,
                                                                 token=token))
        for fd in fds:
            os.close(fd)
        answers: Dict[str, Any] = {"mem": [code_name(r.code), r.message], "mem_fd": bool(fds)}
        for method, request, response in (
                ("GetPosition", pb.GetPositionRequest(session_id=session_id, token=token),
                 pb.GetPositionResponse),
                ("Detach", pb.DetachRequest(session_id=session_id, token=token),
                 pb.DetachResponse)):
            try:
                client.unary(FEED, method, request, response)
                answers[method] = ["OK", ""]
            except grpc.RpcError as e:
                answers[method] = [e.code().name, e.details() or ""]
        stream = Stream(client, session_id, token)
        stream.wait_end(10)
        answers["Stream"] = [stream.end_code or "NOT ENDED", stream.end_message]
        answers["stream_batches"] = stream.batches
        stream.close()
        out[str(session_id)] = answers
    return out


def cmd_lease(a: Dict[str, Any]) -> Dict[str, Any]:
    """The lease attack: open `dataset` (a file this uid may read, perhaps the
    victim's), hand the daemon the descriptor, attach and stream until it maps the file, then
    set the lease signal on this uid's own copy of the descriptor to `signal` (F_SETSIG),
    leaving its owner (the daemon, which took the lease) as it is: on one shared open file
    description that is the signal the kernel sends the daemon when a writer comes. Waits for
    the test's cue, then detaches."""
    client = Client(a["socket"])
    fd = os.open(a["dataset"], os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    request = pb.MemRequest()
    request.open_dataset = True
    response, fds = mem_call(mem_path(client.socket), request, send_fd=fd)
    for extra in fds:
        os.close(extra)
    if response.code != 0:
        return {"error": f"open_dataset: {code_name(response.code)} {response.message}"}
    args = dict(a)
    args["by_path"] = True  # the request is built by hand below: the handle is ours
    r, _, _ = client.attach_request(args)
    r.dataset.handle = response.dataset_handle
    attached = client.unary(FEED, "Attach", r, pb.AttachResponse)
    map_session(client, attached)
    stream = Stream(client, attached.session_id, attached.token)
    got = stream.wait_batches(1, 20)
    fcntl.fcntl(fd, F_SETSIG, a["signal"])
    step("armed", batches=stream.batches, streamed=got)
    stream.close()
    client.detach(attached.session_id, attached.token)
    os.close(fd)
    return {"batches": stream.batches}


def cmd_attach_held(a: Dict[str, Any]) -> Dict[str, Any]:
    """Opens `dataset` (a directory too) now, waits for the test's cue (which may chmod it),
    then trades the descriptor it kept for a handle and attaches: the code and message."""
    client = Client(a["socket"])
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if os.path.isdir(a["dataset"]):
        flags |= os.O_DIRECTORY
    fd = os.open(a["dataset"], flags)
    step("opened")
    request = pb.MemRequest()
    request.open_dataset = True
    response, fds = mem_call(mem_path(client.socket), request, send_fd=fd)
    os.close(fd)
    for extra in fds:
        os.close(extra)
    if response.code != 0:
        return {"code": code_name(response.code), "message": response.message}
    r, _, _ = client.attach_request({**a, "by_path": True})
    r.dataset.handle = response.dataset_handle
    try:
        attached = client.unary(FEED, "Attach", r, pb.AttachResponse)
    except grpc.RpcError as e:
        return {"code": e.code().name, "message": e.details() or ""}
    client.detach(attached.session_id, attached.token)
    return {"code": "OK", "message": "", "num_samples": attached.num_samples}


def goaway_text(data: bytes) -> Optional[str]:
    """The debug text of the first HTTP/2 GOAWAY frame in `data`, or None."""
    at = 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at:at + 3], "big")
        kind = data[at + 3]
        payload = data[at + 9:at + 9 + length]
        if kind == 0x7 and len(payload) >= 8:
            return payload[8:].decode(errors="replace")
        at += 9 + length
    return None


def cmd_connections(a: Dict[str, Any]) -> Dict[str, Any]:
    """Opens `count` idle connections to `path` (default: the gRPC socket) and sends nothing.
    Step "holding" (after `settle_s`): how many the daemon closed, and a GOAWAY's debug text;
    on the cue, closes them all."""
    path = a.get("path") or a["socket"]
    conns: List[socket.socket] = []
    connect_failed = 0
    for _ in range(a["count"]):
        # A full backlog answers EAGAIN at once (AF_UNIX): retried until connect_timeout_s.
        give_up = time.monotonic() + a.get("connect_timeout_s", 5)
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(1)
            try:
                conn.connect(path)
                conns.append(conn)
                break
            except BlockingIOError:
                conn.close()
                if time.monotonic() > give_up:
                    connect_failed += 1
                    break
                time.sleep(0.01)
            except OSError:
                conn.close()
                connect_failed += 1
                break
    time.sleep(a.get("settle_s", 2))
    closed, goaway = 0, None
    for conn in conns:
        conn.setblocking(False)
        data = b""
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    closed += 1
                    break
                data += chunk
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        goaway = goaway or goaway_text(data)
    step("holding", opened=len(conns), closed=closed, connect_failed=connect_failed,
         goaway=goaway)
    for conn in conns:
        conn.close()
    return {"opened": len(conns), "closed": closed, "goaway": goaway}


def cmd_unopened(a: Dict[str, Any]) -> Dict[str, Any]:
    """Starts `streams` Stream calls spread over `channels` connections, none of which ever
    sends its open message. Step "started"; on the cue, waits up to `wait_s` for them to end:
    {"codes": {CODE: n}, "messages": {CODE: a message}, "ended": n, "last_end_s": ...,
    "ends_s": {CODE: [seconds from the start at which each ended, sorted]}}."""
    hold = threading.Event()
    started = time.monotonic()

    def never() -> Iterator[Any]:
        hold.wait()
        return
        yield  # a generator that sends nothing

    channels = [grpc.insecure_channel(f"unix:{a['socket']}",
                                      options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(a["channels"])]
    calls = []
    for i in range(a["streams"]):
        method = channels[i % len(channels)].stream_stream(
            FEED + "Stream", request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.StreamResponse.FromString)
        calls.append(method(never()))
    ends: List[Tuple[str, str, float]] = []
    lock = threading.Lock()

    def done(call: Any) -> None:
        with lock:
            ends.append((call.code().name, call.details() or "", time.monotonic() - started))

    for call in calls:
        call.add_done_callback(done)
    step("started")
    deadline = time.monotonic() + a["wait_s"]
    while time.monotonic() < deadline:
        with lock:
            if len(ends) == len(calls):
                break
        time.sleep(0.05)
    hold.set()
    with lock:
        codes: Dict[str, int] = {}
        messages: Dict[str, str] = {}
        for code, message, _ in ends:
            codes[code] = codes.get(code, 0) + 1
            messages.setdefault(code, message)
        ends_s: Dict[str, List[float]] = {}
        for code, _, t in ends:
            ends_s.setdefault(code, []).append(t)
        result = {"codes": codes, "messages": messages, "ended": len(ends),
                  "last_end_s": max((t for _, _, t in ends), default=None),
                  "ends_s": {code: sorted(ts) for code, ts in ends_s.items()}}
    for call in calls:
        call.cancel()
    for channel in channels:
        channel.close()
    return result


COMMANDS = {"probe": cmd_probe, "mem": cmd_mem, "attach": cmd_attach, "sessions": cmd_sessions,
            "hold": cmd_hold, "dribble": cmd_dribble, "connections": cmd_connections,
            "unopened": cmd_unopened, "lease": cmd_lease, "attach_held": cmd_attach_held}


def main() -> None:
    command, args = sys.argv[1], json.loads(sys.argv[2])
    try:
        result = COMMANDS[command](args)
    except Exception as e:  # reported to the test, which fails on it with the reason
        result = {"error": f"{type(e).__name__}: {e}"}
    emit({"result": result})


if __name__ == "__main__":
    main()
