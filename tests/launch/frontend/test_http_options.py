"""serve.py's HTTP-layer flags (vLLM's): cross-origin access (--allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials), TLS (--ssl-keyfile, --ssl-certfile) and --root-path, on a real `serve.py` under torchrun (1+1
ranks, the tiny checkpoint) with a certificate the test makes with openssl; and the flags' checks."""
from __future__ import annotations

import argparse
import http.client
import json
import shutil
import subprocess

import pytest
from conftest import hf_greedy, make_prompts

from launch.frontend.http_options import add_http_args, http_options
from launch.local_server import LocalServer

KEY = "sk-options"
UI = "https://ui.example"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_http_args(p)
    return p.parse_args(list(argv))


def test_flags_split_into_cors_and_uvicorn_keywords_and_bad_ones_are_named(tmp_path):
    cors, server = http_options(parse("--allowed-origins", f'["{UI}"]', "--allow-credentials", "--root-path", "/x"))
    assert cors == {"allow_origins": [UI], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": True}
    assert server["root_path"] == "/x" and server["ssl_certfile"] is None
    assert http_options(parse())[0]["allow_origins"] == []        # vLLM's default: no cross-origin access
    key = tmp_path / "k.pem"
    key.write_text("x")
    for argv, why in (((("--allowed-origins", "[https://ui]"),), "--allowed-origins '\\[https://ui\\]' is not JSON"),
                      ((("--allowed-headers", '"*"'),), "--allowed-headers '\"\\*\"' is not a JSON list of strings"),
                      ((("--ssl-keyfile", str(key)),), "--ssl-keyfile and --ssl-certfile go together"),
                      ((("--ssl-keyfile", str(key)), ("--ssl-certfile", "/no/cert.pem")),
                       "--ssl-certfile '/no/cert.pem' is not a readable file"),
                      ((("--ssl-cert-reqs", "2"),), "--ssl-cert-reqs 2 checks client certificates: pass --ssl"),
                      ((("--ssl-cert-reqs", "7"),), "--ssl-cert-reqs 7 is invalid"),
                      ((("--root-path", "api"),), "--root-path 'api' is invalid")):
        with pytest.raises(ValueError, match=why):
            http_options(parse(*[x for pair in argv for x in pair]))


def test_a_certificate_and_key_that_do_not_load_together_are_refused_by_name(tls, tmp_path):
    """What uvicorn would fail on only after the start, as a port it cannot listen on."""
    key, cert = tls
    with pytest.raises(ValueError, match=r"--ssl-certfile .* and --ssl-keyfile .* do not load as a certificate"):
        http_options(parse("--ssl-keyfile", cert, "--ssl-certfile", cert))      # a certificate is no private key
    assert http_options(parse("--ssl-keyfile", key, "--ssl-certfile", cert))[1]["ssl_certfile"] == cert


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """(key, certificate) for 127.0.0.1, self-signed."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to serve HTTPS with")
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    return key, cert


def test_https_cors_and_root_path_on_a_real_server(tiny_checkpoint, tls):
    path = tiny_checkpoint("qwen3_moe")
    key, cert = tls
    prompt = make_prompts(1, 256, 7, 7, seed=5)[0]
    with LocalServer(path, nproc=2, args=["--attention-ranks", "1", "--api-key", KEY, "--ssl-keyfile", key,
                                          "--ssl-certfile", cert, "--allowed-origins", f'["{UI}"]',
                                          "--served-model-name", "tiny", "--root-path", "/afserve",
                                          "--enable-request-id-headers"]) as srv:
        assert srv.url.startswith("https://")

        def call(method: str, url: str, body: dict | None = None, **headers) -> tuple[int, dict, bytes]:
            conn = http.client.HTTPSConnection("127.0.0.1", srv.port, timeout=60, context=srv.ssl_context)
            conn.request(method, url, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json", **headers})
            resp = conn.getresponse()
            out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
            conn.close()
            return out
        # a browser's preflight from the allowed origin: answered without the API key
        status, headers, _ = call("OPTIONS", "/v1/completions", Origin=UI, **{
            "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"})
        assert status == 200 and headers["access-control-allow-origin"] == UI, (status, headers)
        status, headers, _ = call("OPTIONS", "/v1/completions", Origin="https://evil.example",
                                  **{"Access-Control-Request-Method": "POST"})
        assert status == 400 and "access-control-allow-origin" not in headers, (status, headers)
        # the request itself, over TLS, from that origin: transformers' tokens, and the origin allowed
        status, headers, raw = call("POST", "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                                 "temperature": 0, "ignore_eos": True,
                                                                 "return_token_ids": True},
                                    Origin=UI, Authorization=f"Bearer {KEY}")
        assert status == 200 and headers["access-control-allow-origin"] == UI, (status, raw[:300])
        assert json.loads(raw)["choices"][0]["token_ids"] == hf_greedy(path, [prompt], 4)[0]
        status, _, raw = call("GET", "/openapi.json")       # the docs carry the proxy's prefix
        assert status == 200 and {"url": "/afserve"} in json.loads(raw)["servers"]
        # as vLLM's: a path that still has the prefix is served too
        status, _, raw = call("GET", "/afserve/v1/models", Authorization=f"Bearer {KEY}")
        assert status == 200 and json.loads(raw)["data"][0]["id"] == "tiny", (status, raw[:200])
        assert call("GET", "/afserve/health")[0] == 200
        # vLLM's X-Request-Id: the request's own comes back, else a new one
        assert call("GET", "/health", **{"X-Request-Id": "trace-7"})[1]["x-request-id"] == "trace-7"
        fresh = [call("GET", "/health")[1]["x-request-id"] for _ in range(2)]
        assert fresh[0] != fresh[1] and all(len(x) == 32 and int(x, 16) >= 0 for x in fresh)
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        with pytest.raises((ConnectionError, http.client.HTTPException)):     # TLS only: plain HTTP gets no answer
            conn.request("GET", "/health")
            conn.getresponse()
        conn.close()
