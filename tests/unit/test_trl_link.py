"""``rolloutpool.integrations.trl`` without a pool: what the rollout hook sends and returns, which
router answers it retries, that it refuses a completion whose spans contradict its binding, the
reward wrapper, and that ``rolloutpool`` imports without TRL.

The router here is a scripted stand-in (``http.server`` on a free port) answering in the real
router's format; ``tests/integration/test_trl_grpo.py`` runs the same hook against the real
router and replicas.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rolloutpool.integrations.trl import PoolLink, PoolRolloutError, ProvenanceError, _runs
from tests.helpers import run_python


def answer(
    n: int, label: str = "run1-step4", generation: int = 3, spans: Any = None
) -> dict[str, Any]:
    """A router answer to ``/inference/v1/generate`` for ``n`` completions of 2 tokens."""
    return {
        "choices": [
            {
                "index": i,
                "token_ids": [4 * i, 4 * i + 1],
                "logprobs": {"content": [{"token_id": 0, "logprob": -1.5}] * 2},
                "weight_versions": (
                    [{"version": label, "start": 0, "end": 2}] if spans is None else spans
                ),
            }
            for i in range(n)
        ],
        "rollout": {
            "id": f"ro-{n}",
            "generation": generation,
            "label": label,
            "identity_digest": "wid:x",
            "replica": "replica-0",
        },
    }


class Router:
    """Scripted stand-in: each POST pops the next (status, body, headers); bodies recorded."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, Any], dict[str, str]]] = []
        self.requests: list[dict[str, Any]] = []
        router = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                router.requests.append(body)
                if router.script:
                    status, out, headers = router.script.pop(0)
                else:
                    status, out, headers = 200, answer(body["sampling_params"]["n"]), {}
                data = json.dumps(out).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def router() -> Iterator[Router]:
    r = Router()
    t = threading.Thread(target=r.server.serve_forever, daemon=True)
    t.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture
def link(router: Router, tmp_path: Path) -> Iterator[PoolLink]:
    lk = PoolLink(
        router.url, "http://127.0.0.1:9", checkpoint_dir=tmp_path, retry_s=10.0, run="run1"
    )
    yield lk
    lk.close()


def trainer(step: int = 5) -> Any:
    """What the hook reads from a GRPOTrainer: tokenizer, sampling args, global step."""
    args = SimpleNamespace(
        temperature=0.9,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        max_completion_length=2,
        chat_template_kwargs=None,
    )
    tokenize = lambda text: {"input_ids": [[len(t), 7] for t in text]}  # noqa: E731
    return SimpleNamespace(
        processing_class=tokenize, args=args, state=SimpleNamespace(global_step=step)
    )


def test_runs_are_consecutive_equal_prompts() -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert _runs(["a", "a", "b", "b", "b", "a"]) == [(0, 2), (2, 3), (5, 1)]
    assert _runs([chat, chat, [*chat, chat[0]]]) == [(0, 2), (2, 1)]


def test_one_request_per_group_and_per_sample_provenance(router: Router, link: PoolLink) -> None:
    out = link.rollout_func(["aa", "aa", "aa", "bbb", "bbb", "bbb"], trainer(step=5))

    assert sorted(r["token_ids"] for r in router.requests) == [[2, 7], [3, 7]]  # concurrent
    sp = router.requests[0]["sampling_params"]
    assert (sp["n"], sp["temperature"], sp["min_p"], sp["max_tokens"], sp["logprobs"]) == (
        3,
        0.9,
        0.0,
        2,
        0,
    )
    assert sp["output_kind"] == 2  # FINAL_ONLY: vLLM 0.26 answers n > 1 with all n only so
    assert out["prompt_ids"] == [[2, 7]] * 3 + [[3, 7]] * 3
    assert out["completion_ids"] == [[0, 1], [4, 5], [8, 9]] * 2
    assert out["logprobs"] == [[-1.5, -1.5]] * 6
    assert out["rollout_generation"] == [3] * 6
    assert out["rollout_policy_step"] == [4] * 6
    assert out["rollout_label"] == ["run1-step4"] * 6
    assert [(s.step, s.generation, s.spans) for s in link.samples] == [(5, 3, ("run1-step4",))] * 6


def test_policy_step_is_read_from_this_runs_labels(link: PoolLink) -> None:
    assert link.policy_step("run1-step12") == 12
    assert link.policy_step("run2-step12") is None  # another run's generation
    assert link.policy_step("g0") is None
    assert link.policy_step("run1-stepx") is None


def test_refused_answers_are_retried_and_counted(router: Router, link: PoolLink) -> None:
    busy = {"error": {"code": "no_admissible_replica", "message": "busy"}}
    ended = {"error": {"code": "binding_ended", "message": "drained"}}
    router.script = [(503, busy, {"Retry-After": "0"}), (503, ended, {})]
    out = link.rollout_func(["x", "x"], trainer())

    assert len(out["completion_ids"]) == 2
    assert len(router.requests) == 3
    assert link.refused == {"no_admissible_replica": 1, "binding_ended": 1}


def test_other_statuses_raise(router: Router, link: PoolLink) -> None:
    router.script = [(409, {"error": {"code": "generation_unavailable", "message": "no"}}, {})]
    with pytest.raises(PoolRolloutError) as e:
        link.rollout_func(["x"], trainer())
    assert e.value.context["status"] == 409
    assert e.value.context["error_code"] == "generation_unavailable"


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "run1-step2", "start": 0, "end": 2}],  # another generation
        [
            {"version": "run1-step4", "start": 0, "end": 1},
            {"version": "run1-step6", "start": 1, "end": 2},
        ],
        [],  # tokens without a span
    ],
)
def test_a_completion_whose_spans_contradict_its_binding_is_refused(
    router: Router, link: PoolLink, spans: list[dict[str, Any]]
) -> None:
    router.script = [(200, answer(2, spans=spans), {})]
    with pytest.raises(ProvenanceError):
        link.rollout_func(["x", "x"], trainer())
    assert link.samples == []


def without_spans(n: int) -> dict[str, Any]:
    """An answer from a replica whose vLLM reports no weight_versions (before 0.32)."""
    out = answer(n)
    for c in out["choices"]:
        del c["weight_versions"]
    return out


def test_an_answer_without_spans_is_refused_unless_the_link_allows_it(
    router: Router, link: PoolLink, tmp_path: Path
) -> None:
    router.script = [(200, without_spans(2), {})]
    with pytest.raises(ProvenanceError, match="require_spans=False"):
        link.rollout_func(["x", "x"], trainer())
    assert link.samples == []

    lenient = PoolLink(
        router.url,
        "http://127.0.0.1:9",
        checkpoint_dir=tmp_path,
        run="run1",
        require_spans=False,
    )
    try:
        router.script = [(200, without_spans(2), {})]
        out = lenient.rollout_func(["x", "x"], trainer())
        assert out["rollout_generation"] == [3, 3]
        assert [s.spans for s in lenient.samples] == [None, None]  # unchecked, not faked
        # spans that are there are still checked
        router.script = [(200, answer(2, spans=[{"version": "run1-step2"}]), {})]
        with pytest.raises(ProvenanceError):
            lenient.rollout_func(["x", "x"], trainer())
    finally:
        lenient.close()


def test_reward_wrapper_logs_lag_and_drops_stale_samples(link: PoolLink) -> None:
    metrics: dict[str, float] = {}
    extra: dict[str, list[Any]] = {}
    seen: dict[str, Any] = {}

    def base(completion_ids: list[list[int]], **kw: Any) -> list[float | None]:
        seen.update(kw)
        return [1.0] * len(completion_ids)

    wrapped = link.reward(base, max_lag_steps=1)
    rewards = wrapped(
        completion_ids=[[1], [2], [3]],
        rollout_generation=[4, 3, 3],
        rollout_policy_step=[9, 8, None],
        trainer_state=SimpleNamespace(global_step=10),
        log_metric=metrics.__setitem__,
        log_extra=extra.__setitem__,
    )

    assert rewards == [1.0, None, None]  # lag 1 kept; lag 2 and unknown lag dropped
    assert wrapped.__name__ == "base"
    assert seen["rollout_generation"] == [4, 3, 3]
    assert metrics["pool/policy_lag_steps"] == 1.5
    assert metrics["pool/policy_lag_steps_max"] == 2.0
    assert metrics["pool/dropped_stale"] == pytest.approx(2 / 3)
    assert extra == {"generation": [4, 3, 3]}


def test_rolloutpool_imports_without_trl() -> None:
    code = (
        "import sys; sys.modules['trl'] = None\n"
        "import rolloutpool, rolloutpool.cli, rolloutpool.embedded, rolloutpool.integrations\n"
        "try:\n"
        "    import rolloutpool.integrations.trl\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    assert "pip install 'rolloutpool[trl]'" in run_python(code)


class StagingUpdater:
    """The updater client as PoolLink uses it from GPU memory: each push is staged and queued
    at once (a resolved future), and ``wait`` blocks until the test ends that update."""

    def __init__(self) -> None:
        self.ended: dict[str, threading.Event] = {}
        self.waited: list[str] = []
        self.calls: queue.Queue[str] = queue.Queue()  # every wait, as it begins
        self.slots: list[int] = []

    def push_module(self, model: Any, checkpoint: Path, *, slots: int, **kw: Any) -> Any:
        from concurrent.futures import Future

        from updater.transports.ipc.pusher import StagedPush

        self.slots.append(slots)
        uid = f"u{len(self.ended) + 1}"
        self.ended[uid] = threading.Event()
        done: Future[dict[str, Any]] = Future()
        done.set_result(
            {"id": uid, "generation": len(self.ended), "label": uid, "identity_digest": uid}
        )
        return StagedPush(None, checkpoint, 0.001, done)  # type: ignore[arg-type]

    def wait(self, update_id: str, timeout_s: float | None = None) -> dict[str, Any]:
        self.waited.append(update_id)
        self.calls.put(update_id)
        assert self.ended[update_id].wait(10)
        return {"replicas": {}}

    def close(self) -> None:
        pass


def test_from_gpu_memory_a_push_waits_only_for_the_older_of_two_in_flight(
    link: PoolLink,
) -> None:
    """wait=False from GPU memory: two updates may be in flight, so the third push waits for
    the first to end (not the second), and three staged copies are kept for it."""
    fake = StagingUpdater()
    link._updater = fake  # type: ignore[assignment]
    link.weights_from, link.wait = "gpu_memory", False
    link._push(None, None, 2)
    link._push(None, None, 4)  # the first is still rolling: no wait
    assert fake.waited == [] and fake.slots == [3, 3]
    third = threading.Thread(target=link._push, args=(None, None, 6))
    third.start()
    assert fake.calls.get(timeout=10) == "u1"  # held by the first update only
    assert third.is_alive()
    fake.ended["u1"].set()
    third.join(10)
    assert not third.is_alive() and fake.waited == ["u1"]
    assert [u.update_id for u in link.updates] == ["u1"]
    for e in fake.ended.values():
        e.set()
    link._settle()
    assert fake.waited == ["u1", "u2", "u3"]
    assert [u.step for u in link.updates] == [2, 4, 6]
