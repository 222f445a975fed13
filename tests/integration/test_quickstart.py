"""The README's quick start, run as written on a fresh default pool, and chat on that pool.

The quick start's code blocks (README "Quick start", up to "More:") are run in their order:
``rolloutpool up`` as a process (the default pool: 2 vLLM CPU replicas of the tiny model, no
``--chat-template``), then ``status``, the ``openai`` snippet (a completion and a chat
completion), ``push`` and ``status`` again, each checked for what it prints. Only the
environment differs from a person's terminal: ``TOKEN`` and ``CKPT`` are what ``up`` printed,
the ports are free ones (``ROLLOUTPOOL_UP_*_PORT=0``, ``ROLLOUTPOOL_ROUTER``/``_UPDATER`` for
the commands, the router's URL in the snippet) and the work dir is a temporary one.

On the same pool, with the ``openai`` SDK unchanged: chat completions whole and streamed, a
session whose turns are ``messages``, and the router's documented minimal bodies against vLLM.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from testkit.procs import terminate
from tests.unit.test_docs import quick_start as readme_quick_start

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DEFAULT_ROUTER = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Block:
    lang: str
    code: str


def quick_start() -> list[Block]:
    """The code blocks of the README's quick start, in order (the docs page repeats them:
    tests/unit/test_docs.py)."""
    return [Block(lang, code) for lang, code in readme_quick_start(README)]


def commands(block: Block) -> list[str]:
    assert block.lang == "bash", block
    return [line for line in block.code.splitlines() if line.strip()]


@dataclass(frozen=True)
class Up:
    proc: subprocess.Popen[bytes]
    log: Path
    what_now: str
    router: str
    env: dict[str, str]  # the second terminal's


def _wait_for(log: Path, proc: subprocess.Popen[bytes], marker: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if marker in text or proc.poll() is not None:
            return text
        time.sleep(0.5)
    return log.read_text(errors="replace")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("quickstart")
    config = root / "pool.yaml"
    config.write_text(yaml.safe_dump({"workdir": str(root / "work")}))
    base = {  # a clean terminal (the model cache kept: the models the other tests use)
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ROLLOUTPOOL_") or k == "ROLLOUTPOOL_CACHE"
    }
    first = commands(quick_start()[0])
    assert len(first) == 1 and first[0].startswith(".venv/bin/rolloutpool up "), first
    log = root / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", first[0]],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={
                **base,
                "ROLLOUTPOOL_CONFIG": str(config),
                "ROLLOUTPOOL_UP_ROUTER_PORT": "0",
                "ROLLOUTPOOL_UP_UPDATER_PORT": "0",
            },
        )
    try:
        text = _wait_for(log, proc, "  stop ", 600)
        assert "What now:" in text, text[-3000:]
        block = text[text.index("RolloutPool is up") :]
        router = re.search(r"router\s+(http://\S+)/v1", block)
        updater = re.search(r"updater\s+(http://\S+)\s", block)
        token = re.search(r"admin token: (\S+)\)", block)
        push = re.search(r"^\s+push\s+(rolloutpool push .+)$", block, re.M)
        assert router and updater and token and push, block
        env = {
            **base,
            "TOKEN": token.group(1),
            "CKPT": shlex.split(push.group(1))[2],
            "ROLLOUTPOOL_ROUTER": router.group(1),
            "ROLLOUTPOOL_UPDATER": updater.group(1),
        }
        yield Up(proc, log, block, router.group(1), env)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        assert proc.wait(120) == 0
        assert log.read_text().rstrip().endswith("stopped")
    finally:
        terminate(proc)


def run_bash(line: str, up: Up) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        ["bash", "-c", line], cwd=REPO, env=up.env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
    return r


def replica_rows(status: str) -> list[list[str]]:
    return [x.split() for x in status.splitlines() if x.startswith("replica-")]


def test_the_quick_start_runs_as_written(up: Up) -> None:
    blocks = quick_start()
    assert [b.lang for b in blocks] == ["bash", "bash", "python", "bash"]

    assert "RolloutPool is up: 2 of 2 replicas READY, serving generation 0." in up.what_now

    [status] = commands(blocks[1])
    out = run_bash(status, up).stdout
    assert out.splitlines()[1].startswith("published    generation 0 (g0)"), out
    rows = replica_rows(out)
    assert [r[:4] for r in rows] == [
        ["replica-0", "READY", "0", "g0"],
        ["replica-1", "READY", "0", "g0"],
    ]
    assert "last update  none yet" in out

    assert DEFAULT_ROUTER in blocks[2].code
    snippet = blocks[2].code.replace(DEFAULT_ROUTER, up.router)
    r = subprocess.run(
        [sys.executable, "-c", snippet], env=up.env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    rollout_line, chat_line = r.stdout.rstrip("\n").split("\n")[-2:]
    rollout = ast.literal_eval(rollout_line)  # the dict print() wrote
    assert set(rollout) == {"id", "generation", "label", "identity_digest", "replica"}
    assert (rollout["generation"], rollout["label"]) == (0, "g0")
    assert rollout["replica"] in {"replica-0", "replica-1"}
    assert chat_line.endswith(" 0")  # the chat's text, then its generation

    push, status_again = commands(blocks[3])
    out = run_bash(push, up).stdout
    assert re.search(r"update up-\w+ succeeded: generation 1 \(g1\)", out.splitlines()[-1]), out
    out = run_bash(status_again, up).stdout
    assert out.splitlines()[1].startswith("published    generation 1 (g1)"), out
    assert [r[:4] for r in replica_rows(out)] == [
        ["replica-0", "READY", "1", "g1"],
        ["replica-1", "READY", "1", "g1"],
    ]
    assert re.search(r"last update  up-\w+: generation 1 \(g1\) succeeded", out), out


@pytest.fixture(scope="module")
def client(up: Up) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{up.router}/v1", api_key="unused") as c:
        yield c


HELLO: list[Any] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
]


def test_chat_completions_whole_and_streamed(up: Up, client: OpenAI) -> None:
    transformers: Any = importlib.import_module("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(up.env["CKPT"])
    prompt = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<s>system\nbe brief</s>\n")  # the model's own template
    chat = client.chat.completions.create(
        model="rolloutpool",
        messages=HELLO,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = chat.choices[0].message.content
    assert text and chat.usage is not None and chat.usage.completion_tokens == 8
    assert chat.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)
    rollout = (chat.model_extra or {})["rollout"]
    assert {"id", "generation", "label", "replica"} <= set(rollout)

    stream = client.chat.completions.create(
        model="rolloutpool",
        messages=HELLO,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same answer, whole or streamed
    last = chunks[-1]
    assert last.usage is not None and last.usage.completion_tokens == 8
    assert (last.model_extra or {})["rollout"]["generation"] == rollout["generation"]

    parts = client.chat.completions.create(  # content as a list of text parts
        model="rolloutpool",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        max_tokens=2,
    )
    assert parts.choices[0].message.content is not None


def test_a_session_whose_turns_are_messages(up: Up, client: OpenAI) -> None:
    with httpx.Client(base_url=up.router, timeout=60) as http:
        r = http.post("/v1/rollouts")
        assert r.status_code == 201, r.text
        session = r.json()
        sid = session["rollout_id"]
        messages: list[Any] = [{"role": "user", "content": "hello"}]
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="rolloutpool",
                messages=messages,
                max_tokens=4,
                extra_headers={"X-Rollout-Id": sid},
            )
            chat = raw.parse()
            assert raw.headers["X-Rollout-Id"] == sid
            assert raw.headers["X-Rollout-Replica"] == session["replica"]
            assert int(raw.headers["X-Rollout-Generation"]) == session["generation"]
            messages += [
                {"role": "assistant", "content": chat.choices[0].message.content or ""},
                {"role": "user", "content": f"and turn {turn + 2}?"},
            ]
        r = http.post(f"/v1/rollouts/{sid}/close")
        assert r.status_code == 200, r.text
        closed = r.json()
    assert closed["state"] == "finished" and closed["requests"] == 3


ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")


def test_the_documented_required_fields_are_what_vllm_requires(up: Up) -> None:
    """A body of exactly the fields the router's document requires (its example's values) is
    answered 200 by vLLM; without any one of them it is refused with a 4xx."""
    with httpx.Client(base_url=up.router, timeout=120) as http:
        doc = http.get("/openapi.json").json()
        for route in ROUTES:
            body = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]
            required, example = body["schema"]["required"], body["example"]
            minimal = {k: example[k] for k in required}
            if route == "/v1/chat/completions":  # vLLM's default: up to the context length
                minimal["max_tokens"] = 4
            r = http.post(route, json=minimal)
            assert r.status_code == 200, (route, minimal, r.text)
            for field in required:
                without = {k: v for k, v in minimal.items() if k != field}
                r = http.post(route, json=without)
                assert 400 <= r.status_code < 500, (route, field, r.status_code, r.text)
                assert json.loads(r.text), r.text
