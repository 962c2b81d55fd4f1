"""Server conventions a vLLM user reaches for (issue 31): /version, /ping, HTTPS
(--ssl-keyfile/--ssl-certfile), CORS (--allowed-origins ...), --chat-template at
start-up, --uvicorn-log-level and request logging; one real server, with an API key."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import httpx
import openai
import pytest

from tests.server_utils import ServerProcess

KEY = "conventions-key"
ORIGIN = "https://app.example"
TEMPLATE = "{% for m in messages %}<<{{ m.role }}: {{ m.content }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"


class HTTPSServer(ServerProcess):
    """The suite's server process, spoken to over HTTPS with a self-signed certificate."""

    def __init__(self, *args: str, cert: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.url = f"https://127.0.0.1:{self.port}"
        self.cert = ssl.create_default_context(cafile=cert)  # trusts the self-signed certificate

    def _wait_healthy(self) -> None:
        original = httpx.get
        httpx.get = lambda *a, **k: original(*a, verify=self.cert, **k)  # the base class's probe
        try:
            super()._wait_healthy()
        finally:
            httpx.get = original

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, headers={**self.headers, **kwargs.pop("headers", {})}, verify=self.cert,
                         timeout=60, **kwargs)

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        return httpx.request(method, self.url + path, verify=self.cert, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test's self-signed certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    template = folder / "template.jinja"
    template.write_text(TEMPLATE)
    process = HTTPSServer("--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                          "--allowed-origins", f'["{ORIGIN}"]', "--chat-template", str(template),
                          "--uvicorn-log-level", "warning", "--enable-log-requests",
                          cert=str(cert), api_key=KEY).start()
    yield process
    assert process.stop() == 0, process.log_tail()


def test_ping_and_version_answer_like_health(server):
    for method in ("GET", "POST"):
        response = server.request(method, "/ping")  # open, as /health is, without the key
        assert response.status_code == 200 and response.json() == {"status": "ok"}
    version = server.request("GET", "/version")
    assert version.status_code == 200 and version.json()["version"]


def test_https_serves_the_openai_client_and_refuses_plain_http(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, http_client=httpx.Client(verify=server.cert))
    completion = client.completions.create(model=server.model, prompt="The sea is", max_tokens=3)
    assert completion.choices[0].text
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)


def test_cors_answers_allowed_origins_only(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = server.request("OPTIONS", "/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200, allowed.text  # no API key on a preflight
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = server.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    simple = server.request("GET", "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == ORIGIN


def test_the_start_up_chat_template_renders_chats(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    tokens = server.request("POST", "/tokenize", headers=auth,
                            json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    text = server.request("POST", "/detokenize", headers=auth, json={"tokens": tokens}).json()["prompt"]
    assert text == "<<user: hi>>=>"


def test_request_logging_and_uvicorn_level(server):
    server.request("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "Hello", "max_tokens": 2})
    log = server.log_tail(200_000)
    assert "received request cmpl-" in log and "Hello" not in log.split("received request", 1)[1].split("\n")[0]
    assert "Uvicorn running on" not in log  # uvicorn's INFO lines are off at --uvicorn-log-level warning
