"""Who may talk to a server, and over what: API keys, the admin key, TLS and mutual TLS.

Servers (router and worker) take a `SecurityConfig`:
- **API keys** for inference (gRPC `Generation`, HTTP `/v1/*`, `/metrics`): gRPC metadata
  `authorization: Bearer KEY` (else UNAUTHENTICATED), HTTP `Authorization: Bearer KEY`
  (else 401). With no key configured, inference is open, as before.
- **The admin key** for everything that changes or inspects the fleet (`AddWorker`,
  `RemoveWorker`, `DrainWorker`, `ListWorkers`, `WorkerAdmin/*` and any RPC of those
  services added later): an inference key there is PERMISSION_DENIED. Once any key is
  configured, admin RPCs need the admin key (none configured: they are refused).
  Registration and heartbeats are the workers' (the join token, and mutual TLS).
- **TLS** with `tls_cert` + `tls_key` on gRPC and HTTP; with `tls_ca` too, gRPC is mutual
  TLS: every gRPC client presents a certificate of the fleet CA (`orchard certs`), and a
  worker's id is bound to its certificate's name. HTTP stays server-side TLS + API keys.
- **Host checking** on HTTP against DNS rebinding (`allowed_hosts`).

Clients (SDK, CLI, the router dialling workers, a worker registering) take a
`ClientSecurity` and open channels with `channel()`. Keys are compared in constant time
and never logged.
"""

from __future__ import annotations

import hmac
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.config import setting
from cluster.net import is_loopback

INFERENCE, ADMIN, FLEET, OPEN = "inference", "admin", "fleet", "open"
# What each RPC needs. Anything else of the Router and WorkerAdmin services is admin, so
# an RPC added later is closed until it is listed here.
METHOD_ROLES = {
    "/orchard.v1.Router/RegisterWorker": FLEET,  # the join token, in the request
    "/orchard.v1.Router/Heartbeat": FLEET,
    "/orchard.v1.Router/ReportFailure": FLEET,
    "/orchard.v1.Fleet/RegisterNode": FLEET,  # node agents: the join token, in the request
    "/orchard.v1.Fleet/NodeHeartbeat": FLEET,
}
# `Generation` is what clients call, on a worker and on the router alike: every RPC of it
# (generate, embed, score, tokenize, list models) is inference.
INFERENCE_SERVICES = ("/orchard.v1.Generation/",)
# A node agent's own service: the router presents the join token as its bearer key, which
# the agent checks itself (cluster/fleet/agent.py).
FLEET_SERVICES = ("/orchard.v1.Node/",)
ADMIN_SERVICES = ("/orchard.v1.Router/", "/orchard.v1.WorkerAdmin/")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def role_of(method: str) -> str:
    if method in METHOD_ROLES:
        return METHOD_ROLES[method]
    if method.startswith(INFERENCE_SERVICES):
        return INFERENCE
    if method.startswith(FLEET_SERVICES):
        return FLEET
    if method.startswith(ADMIN_SERVICES):
        return ADMIN
    if method.startswith("/orchard."):
        return ADMIN  # a new service of ours: closed until listed
    return OPEN  # gRPC health


@dataclass(frozen=True)
class SecurityConfig:
    """A server's credentials and transport security (router and worker alike)."""

    api_keys: tuple[str, ...] = setting(
        (), "an API key clients must present for inference (repeatable; also $ORCHARD_API_KEY, comma-separated, "
            "or --api-key-file). None: inference is open", flag="--api-key", repeat=True, metavar="KEY")
    api_key_file: str | None = setting(None, "a file of API keys, one per line (keep it mode 0600)", metavar="FILE")
    admin_key: str = setting("", "the key for what changes the cluster (register, remove, drain, list workers)",
                             env="ORCHARD_ADMIN_KEY", metavar="KEY")
    tls_cert: str | None = setting(None, "this server's certificate (PEM): gRPC and HTTP over TLS", metavar="FILE")
    tls_key: str | None = setting(None, "the certificate's private key (PEM)", metavar="FILE")
    tls_ca: str | None = setting(None, "the fleet CA (PEM): gRPC clients must present a certificate it signed "
                                       "(mutual TLS); the router and workers also verify each other with it",
                                 metavar="FILE")
    allowed_hosts: str | None = setting(
        None, "comma-separated Host names the HTTP API answers (against DNS rebinding; default: the loopback "
              "names when bound to loopback, any otherwise)", metavar="HOSTS")
    cors_origins: str | None = setting(
        None, "comma-separated origins (https://app.example) whose browser pages may call the HTTP API (CORS), "
              "or * for any; default: none", metavar="ORIGINS")

    def check(self) -> None:
        """ValueError naming what is wrong (a missing file, a key without its certificate)."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca on a server needs --tls-cert and --tls-key (mutual TLS)")
        for name in ("api_key_file", "tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')} {path}: no such file")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def mutual(self) -> bool:
        return bool(self.tls_ca)

    def keys(self) -> "Keys":
        return Keys(inference_keys(self.api_keys, self.api_key_file), self.admin_key)

    def client(self) -> "ClientSecurity":
        """How this server dials its peers (the router its workers, a worker its routers):
        its own certificate as the client's, the fleet CA, the admin key (else an API key)."""
        keys = self.keys()
        return ClientSecurity(api_key=self.admin_key or next(iter(keys.inference), ""),
                              tls_ca=self.tls_ca, tls_cert=self.tls_cert if self.tls_ca else None,
                              tls_key=self.tls_key if self.tls_ca else None)


def inference_keys(flags: tuple[str, ...] = (), key_file: str | None = None) -> tuple[str, ...]:
    keys = list(flags)
    keys += [k.strip() for k in os.environ.get("ORCHARD_API_KEY", "").split(",") if k.strip()]
    if key_file:
        _warn_if_readable_by_others(key_file)
        keys += [line.strip() for line in Path(key_file).read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(keys))


def _warn_if_readable_by_others(path: str) -> None:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        import logging

        logging.getLogger(__name__).warning("%s is readable by other users: chmod 600 it", path)


class Keys:
    """The keys a server accepts, and what each may do."""

    def __init__(self, inference: tuple[str, ...] = (), admin: str = ""):
        self.inference = tuple(k.encode() for k in inference)
        self.admin = admin.encode() if admin else b""

    @property
    def open(self) -> bool:
        return not self.inference and not self.admin

    def _is_admin(self, key: bytes) -> bool:
        return bool(self.admin) and hmac.compare_digest(key, self.admin)

    def _is_inference(self, key: bytes) -> bool:
        ok = False
        for k in self.inference:  # no early exit: the time does not say which key matched
            ok |= hmac.compare_digest(key, k)
        return ok

    def refusal(self, authorization: str | None, role: str) -> tuple[str, str] | None:
        """None if a request with this Authorization value may do `role`; else
        ("unauthenticated" | "permission_denied", message)."""
        if role in (OPEN, FLEET):
            return None
        if role == INFERENCE and not self.inference:
            return None  # inference is open (an admin key alone guards admin)
        if role == ADMIN and self.open:
            return None
        key = _bearer(authorization)
        if key is None:
            return ("unauthenticated", "this server needs an API key: send 'authorization: Bearer KEY'"
                    if role == INFERENCE else "this is an admin operation: send the admin key as "
                                              "'authorization: Bearer KEY' (--admin-key / $ORCHARD_ADMIN_KEY)")
        if self._is_admin(key):
            return None
        valid = self._is_inference(key)
        if role == INFERENCE:
            return None if valid else ("unauthenticated", "invalid API key")
        if valid:
            return ("permission_denied", "an API key is not the admin key: this operation needs the admin key"
                    + ("" if self.admin else " (this server has none configured: start it with --admin-key)"))
        return ("unauthenticated", "invalid admin key")


def _bearer(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip().encode()


# -- gRPC servers ---------------------------------------------------------------------------

_CODES = {"unauthenticated": grpc.StatusCode.UNAUTHENTICATED, "permission_denied": grpc.StatusCode.PERMISSION_DENIED}


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses an RPC whose credentials do not allow its role (`role_of`) before the
    servicer sees it."""

    def __init__(self, keys: Keys):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or self.keys.open:
            return handler
        metadata = dict(details.invocation_metadata or ())
        refused = self.keys.refusal(metadata.get("authorization"), role_of(details.method))
        if refused is None:
            return handler
        code, message = _CODES[refused[0]], refused[1]

        async def deny_unary(request, context):
            await context.abort(code, message)

        async def deny_stream(request, context):
            await context.abort(code, message)
            yield  # pragma: no cover  (an async generator)

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for a gRPC server (mutual when `tls_ca`), or None: plaintext."""
    if not config.tls:
        return None
    pair = [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
    if config.tls_ca:
        return grpc.ssl_server_credentials(pair, root_certificates=Path(config.tls_ca).read_bytes(),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def http_ssl_context(config: SecurityConfig):
    """An ssl.SSLContext for the HTTP servers (server-side TLS), or None."""
    if not config.tls:
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    return ctx


def peer_identity(context) -> str | None:
    """The name on a gRPC peer's verified client certificate (mutual TLS), else None."""
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001  (no transport security)
        return None
    names = auth.get("x509_common_name") or []
    return names[0].decode() if names else None


def allowed_hosts(config: SecurityConfig, bound_host: str) -> tuple[str, ...] | None:
    """The Host names the HTTP API answers: the configured ones; by default the loopback
    names when bound to loopback; None: any."""
    if config.allowed_hosts:
        return tuple(h.strip().lower() for h in config.allowed_hosts.split(",") if h.strip())
    return LOOPBACK_HOSTS if is_loopback(bound_host) else None


def host_allowed(host_header: str | None, allowed: tuple[str, ...] | None) -> bool:
    if allowed is None:
        return True
    if not host_header:
        return False
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[: host.find("]") + 1]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host in allowed or "*" in allowed


# -- clients ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClientSecurity:
    """What a client presents: a key, and for TLS the CA to verify the server with (plus
    its own certificate and key for mutual TLS)."""

    api_key: str = ""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_env(cls, api_key: str | None = None, admin: bool = False, **tls) -> "ClientSecurity":
        """A key given, else $ORCHARD_ADMIN_KEY (admin commands) or the first of $ORCHARD_API_KEY."""
        if not api_key:
            api_key = os.environ.get("ORCHARD_ADMIN_KEY", "") if admin else ""
            api_key = api_key or next(iter(inference_keys()), "")
        tls = {k: v or os.environ.get(f"ORCHARD_{k.upper()}") for k, v in tls.items()}
        return cls(api_key=api_key, **{k: v for k, v in tls.items() if v})

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca:
            return None
        read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.tls_ca), read(self.tls_key), read(self.tls_cert))


NO_SECURITY = ClientSecurity()


def channel(target: str, security: ClientSecurity = NO_SECURITY, *, aio: bool = True, options=None):
    """A gRPC channel to `target` that presents `security` (TLS when it has a CA, the key
    on every call)."""
    options = list(options or [])
    creds = security.channel_credentials()
    md = security.metadata()
    if aio:
        interceptors = [_AioUnary(md), _AioStream(md)] if md else None
        if creds is not None:
            return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    ch = grpc.secure_channel(target, creds, options=options) if creds is not None else \
        grpc.insecure_channel(target, options=options)
    return grpc.intercept_channel(ch, _SyncKey(md)) if md else ch


class _KeyMetadata:
    """Adds the key to every call's metadata."""

    def __init__(self, metadata):
        self._metadata = tuple(metadata)

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)  # asyncio: a coroutine, which it awaits

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


# an asyncio channel files each interceptor under its first kind only: one class per kind
class _AioUnary(_KeyMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    pass


class _AioStream(_KeyMetadata, grpc.aio.UnaryStreamClientInterceptor):
    pass


class _SyncKey(_KeyMetadata, grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    pass


def add_client_flags(parser, admin: bool = False) -> None:
    """A client command's credentials: flags, each also from the environment."""
    if admin:
        parser.add_argument("--admin-key", default=None, metavar="KEY",
                            help="the router's admin key (default: $ORCHARD_ADMIN_KEY)")
    else:
        parser.add_argument("--api-key", default=None, metavar="KEY", help="an API key (default: $ORCHARD_API_KEY)")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="the fleet CA: connect over TLS and verify the server (default: $ORCHARD_TLS_CA)")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="a client certificate, for servers with mutual TLS (default: $ORCHARD_TLS_CERT)")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="its key (default: $ORCHARD_TLS_KEY)")


def client_from_args(args, admin: bool = False) -> ClientSecurity:
    key = getattr(args, "admin_key" if admin else "api_key", None)
    return ClientSecurity.from_env(key, admin=admin, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
