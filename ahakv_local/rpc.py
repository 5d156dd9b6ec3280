"""llama.cpp RPC workers: the model's layers on other processes or machines (``--rpc HOST:PORT,...``).

A worker is llama.cpp's ``ggml-rpc-server``, built by ``ahakv-local build --rpc`` from the same patched tree
as the client and shipped in ``llama_cpp/lib``; ``ahakv-local rpc-server`` starts it. The client turns each
address into ggml devices (``ggml_backend_rpc_add_server``) and hands them to llama.cpp in
``llama_model_params.devices``, so only the model that asked uses them. llama.cpp aborts the whole process on
an address it cannot reach or a worker of another protocol version, so every address is first checked here
with the protocol's own handshake: a mistake is one line, not a crash.

The RPC protocol is unauthenticated and unencrypted: run workers on a trusted network only.
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import os
import socket
import struct
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path

from .errors import AhakvError

RPC_SERVER = "ggml-rpc-server"  # the worker's file name in llama_cpp/lib (patch 0012)
PROTO_MAJOR, PROTO_MINOR = 7, 0  # RPC_PROTO_*_VERSION of ggml-rpc.h in the pinned sdist
_HELLO = 14  # RPC_CMD_HELLO
_CAPS = 24  # RPC_CONN_CAPS_SIZE
_p = ctypes.c_void_p
_GGML = {  # the backend registry functions of libggml this module calls
    "ggml_backend_reg_by_name": ([ctypes.c_char_p], _p),
    "ggml_backend_reg_get_proc_address": ([_p, ctypes.c_char_p], _p),
    "ggml_backend_reg_dev_count": ([_p], ctypes.c_size_t),
    "ggml_backend_reg_dev_get": ([_p, ctypes.c_size_t], _p),
}
OPTION_HELP = (
    "llama.cpp RPC workers (`ahakv-local rpc-server`) to hold the layers: all of them unless -ngl says how many. "
    "The protocol is unauthenticated: use it on a trusted network only."
)
OPTION_HELP_EVERY_LAYER = (
    "llama.cpp RPC workers (`ahakv-local rpc-server`) to hold every layer of every run. The protocol is "
    "unauthenticated: use it on a trusted network only."
)
BUILD_HINT = "the installed engine has no RPC backend: run `ahakv-local build --rpc`"


def parse_servers(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``"host:port,host:port"`` (or a list of them) as endpoints; a malformed one is an AhakvError."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    endpoints = tuple(s.strip() for s in items if s.strip())
    if not endpoints:
        raise AhakvError(f"no RPC worker in {spec!r}: give HOST:PORT[,HOST:PORT...]")
    for ep in endpoints:
        host, sep, port = ep.rpartition(":")
        # ASCII digits only: str.isdigit() takes "٥٠١٠٠" and "5²", which llama.cpp's parser aborts on
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise AhakvError(f"bad RPC worker address {ep!r}: expected HOST:PORT with a port from 1 to 65535")
        if ":" in host:  # llama.cpp splits at the first ':', so an IPv6 literal cannot be addressed
            raise AhakvError(f"bad RPC worker address {ep!r}: use a host name or an IPv4 address")
    if len(set(endpoints)) != len(endpoints):
        raise AhakvError(f"RPC worker listed twice in {spec!r}")
    return endpoints


def check_worker(endpoint: str, timeout: float = 5.0) -> None:
    """Connect and say hello as llama.cpp's client does: refused, silent or foreign workers are AhakvErrors.
    (A worker serves one client at a time; this connection is closed before the model's own one opens.)"""
    host, _, port = endpoint.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise AhakvError(
            f"cannot reach the RPC worker {endpoint} ({why}): start one there with "
            f"`ahakv-local rpc-server --host HOST --port {port}`"
        ) from None
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", _HELLO, _CAPS) + bytes(_CAPS))
            reply = _recv(sock, 8 + 4 + _CAPS)
        except TimeoutError:  # it accepted the connection: a worker serving someone else answers only when free
            raise AhakvError(
                f"{endpoint} accepted the connection but did not answer the RPC handshake within {timeout:g} s: "
                "a worker busy with another client (it serves one at a time), or not an RPC worker"
            ) from None
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
            raise AhakvError(f"the RPC worker {endpoint} closed the handshake ({why})") from None
    (size,) = struct.unpack_from("<Q", reply)
    major, minor = reply[8], reply[9]
    if size != 4 + _CAPS or major != PROTO_MAJOR or minor > PROTO_MINOR:
        raise AhakvError(
            f"{endpoint} is not an RPC worker of this engine (protocol {major}.{minor}, expected {PROTO_MAJOR}.x): "
            "start it with `ahakv-local rpc-server` from the same ahakv-local"
        )


def worker_address(endpoint: str) -> tuple[str, int]:
    """(IPv4 address, port) of ``HOST:PORT``: what tells two names of one worker apart from two workers. Every
    address of this machine is one (127.0.0.1, 127.0.0.2, 0.0.0.0, its own network address all reach a worker that
    listens on 0.0.0.0: two such names hung the load, a second connection waiting on the first). An unresolvable
    host is an AhakvError, as llama.cpp would abort on it."""
    host, _, port = endpoint.rpartition(":")
    address = resolve_ipv4(host, f"the RPC worker {endpoint}")
    ip = ipaddress.ip_address(address)
    if ip.is_loopback or ip.is_unspecified or address in _own_addresses():
        address = "127.0.0.1"
    return address, int(port)


@functools.cache
def _own_addresses() -> frozenset[str]:
    """This machine's IPv4 addresses, as its host name resolves (none where it does not)."""
    try:
        return frozenset(socket.gethostbyname_ex(socket.gethostname())[2])
    except (OSError, UnicodeError):
        return frozenset()


def resolve_ipv4(host: str, what: str) -> str:
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise AhakvError(f"cannot resolve the host of {what} ({why})") from None


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(104, "closed the connection during the handshake")
        data += chunk
    return data


class Devices:
    """The ggml devices of some workers as a NULL-terminated ``ggml_backend_dev_t`` array for
    ``llama_model_params.devices`` (the array lives as long as this object; llama.cpp copies it at load)."""

    def __init__(self, endpoints: Sequence[str]):
        from . import upstream

        self.endpoints = tuple(endpoints)
        # one worker under two names (localhost and 127.0.0.1, a port 050100) would take a second connection,
        # which a worker serving one client at a time leaves waiting for ever
        self.workers = tuple(worker_address(ep) for ep in self.endpoints)
        for i, worker in enumerate(self.workers):
            if worker in self.workers[:i]:
                first = self.endpoints[self.workers.index(worker)]
                raise AhakvError(
                    f"RPC worker listed twice: {first} and {self.endpoints[i]} are both {worker[0]}:{worker[1]}"
                )
        # every address before llama.cpp sees one (it aborts on a bad one); not those a live model of this
        # process is connected to: a worker serves one connection at a time, so a probe would wait there
        busy = {w: ep for devices in _IN_USE for w, ep in zip(devices.workers, devices.endpoints, strict=True)}
        for ep, worker in zip(self.endpoints, self.workers, strict=True):
            if worker not in busy:
                check_worker(ep)
            elif busy[worker] != ep:  # llama.cpp shares a connection by name: another name opened a second one, which
                # the worker left waiting (the load hung for good)
                raise AhakvError(
                    f"the RPC worker {ep} is {busy[worker]}, which a model of this process is connected to: name it "
                    f"{busy[worker]} here too (a worker serves one connection at a time)"
                )
        ggml = upstream.ggml_cdll()
        for name, (argtypes, restype) in _GGML.items():
            fn = getattr(ggml, name)
            fn.argtypes, fn.restype = argtypes, restype
        rpc = ggml.ggml_backend_reg_by_name(b"RPC")
        add = rpc and ggml.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server")
        if not add:
            raise AhakvError(BUILD_HINT)
        add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)
        devices: list[int] = []
        for ep in self.endpoints:
            reg = add_server(ep.encode())
            if not reg:
                raise AhakvError(f"the RPC worker {ep} offers no device")
            devices += [ggml.ggml_backend_reg_dev_get(reg, i) for i in range(ggml.ggml_backend_reg_dev_count(reg))]
        self.array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        _IN_USE.add(self)

    @property
    def pointer(self) -> int:
        return ctypes.addressof(self.array)


def configure(params, devices: Devices | None, repack_weights: bool) -> None:
    """Set a ``llama_model_params`` for these workers (none: this machine only) and weight repacking. The layers
    they hold are ``n_gpu_layers``'s, which the callers default to every layer with workers (``default_layers``)."""
    params.use_extra_bufts = repack_weights
    if devices is not None:
        params.devices = devices.pointer


def default_layers(rpc_servers: Sequence[str]) -> int:
    """The layers offloaded when none are asked for: every one (llama.cpp's -1) with workers, that is what --rpc is
    for; none without. An explicit 0 keeps every layer on this machine."""
    return -1 if rpc_servers else 0


_IN_USE: weakref.WeakSet[Devices] = weakref.WeakSet()  # the devices of models this process holds


def server_binary() -> Path:
    """The worker the installed engine ships; an AhakvError naming the build command when there is none."""
    from .build import installed_package

    pkg = installed_package()
    exe = pkg / "lib" / (RPC_SERVER + (".exe" if sys.platform == "win32" else "")) if pkg else None
    if exe is None or not exe.is_file():
        raise AhakvError(f"{BUILD_HINT} (it ships the {RPC_SERVER} worker)")
    return exe


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the worker binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise AhakvError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve(host: str, port: int, threads: int | None) -> None:
    """Replace this process by the worker (signals and exit code are the worker's own)."""
    exe = server_binary()
    # the worker takes a numeric IPv4 address only: a name failed there with exit code 0
    host = resolve_ipv4(host, f"--host {host!r}") if host else ""
    if not host:
        raise AhakvError("--host is empty: give an IPv4 address or a host name (127.0.0.1, 0.0.0.0, a LAN address)")
    check_port_free(host, port)
    args = [str(exe), "--host", host, "--port", str(port)]
    if threads:
        args += ["--threads", str(threads)]
    sys.stderr.flush()
    os.execv(exe, args)
