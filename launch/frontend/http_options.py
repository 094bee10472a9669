"""serve.py's HTTP-layer flags, vLLM's: cross-origin access (CORS: --allowed-origins, --allowed-methods,
--allowed-headers as JSON lists, --allow-credentials), TLS (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs), --root-path (behind a proxy that routes a path prefix here) and --enable-request-id-headers.
`http_options` checks them and splits them into the CORS middleware's keywords and the server's
(launch/frontend/process.py applies both: TLS goes to uvicorn, the root path to the app, as vLLM's, so paths with
and without the prefix are served)."""
from __future__ import annotations

import argparse
import json
import os
import ssl


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allowed-origins", default="[]", metavar="JSON",
                   help="origins a browser may call from, as a JSON list (e.g. '[\"https://ui.example\"]' or "
                        "'[\"*\"]'; default [], no cross-origin access; vLLM's flag)")
    p.add_argument("--allowed-methods", default='["*"]', metavar="JSON", help="CORS methods, a JSON list (default all)")
    p.add_argument("--allowed-headers", default='["*"]', metavar="JSON", help="CORS headers, a JSON list (default all)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: let browsers send credentials")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (with --ssl-keyfile)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates to check client certificates against")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                   help="client certificates: 0 none (default), 1 optional, 2 required (Python's ssl.CERT_*)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every answer carries an X-Request-Id header: the request's own, else a new one (vLLM's flag)")
    p.add_argument("--root-path", default=None, help="the path prefix a proxy routes to this server (FastAPI's "
                                                     "root_path: the API docs and their links carry it)")


def http_options(args: argparse.Namespace) -> tuple[dict, dict]:
    """-> (CORSMiddleware's keywords, the server's: uvicorn.Config's TLS keywords, and the app's "root_path" and
    "request_id_headers"); a ValueError names the flag and what is wrong."""
    cors = {}
    for flag, key in (("allowed_origins", "allow_origins"), ("allowed_methods", "allow_methods"),
                      ("allowed_headers", "allow_headers")):
        raw = getattr(args, flag)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--{flag.replace('_', '-')} {raw!r} is not JSON: pass a list such as '[\"*\"]' "
                             f"({e.msg})") from e
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"--{flag.replace('_', '-')} {raw!r} is not a JSON list of strings")
        cors[key] = value
    cors["allow_credentials"] = bool(args.allow_credentials)
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: pass both to serve HTTPS, or neither")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ValueError(f"--{flag.replace('_', '-')} {path!r} is not a readable file")
    if args.ssl_certfile is not None:       # what uvicorn would fail on later, as "cannot listen"
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-certfile {args.ssl_certfile!r} and --ssl-keyfile {args.ssl_keyfile!r} do not "
                             f"load as a certificate and its private key: {e}") from e
    if args.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs {args.ssl_cert_reqs} is invalid: pass 0 (none), 1 (optional) or 2 "
                         f"(required)")
    if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        raise ValueError(f"--ssl-cert-reqs {args.ssl_cert_reqs} checks client certificates: pass --ssl-ca-certs")
    if args.root_path is not None and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path {args.root_path!r} is invalid: pass a path that starts with '/'")
    server = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs,
              "ssl_cert_reqs": args.ssl_cert_reqs, "root_path": args.root_path or "",
              "request_id_headers": bool(args.enable_request_id_headers)}
    return cors, server
