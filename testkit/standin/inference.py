"""``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate`` of a stand-in.

A call is parsed and checked in vLLM's order (schema, ``cache_salt``, model name -> 404, prompt,
vocabulary, context length, ``max_tokens``), becomes one :class:`~testkit.standin.engine.
SimRequest` per choice (``n`` per prompt; a completion may carry a batch of prompts), and is
answered when all of them end, or streamed as they run: the SSE headers go out at once (so a
request queued behind a pause sees a 200 and then silence, as on vLLM), then one chunk per
choice per engine tick. A client that disconnects aborts its requests; a replica that dies
drops the connection. ``temperature`` 0 is greedy (:func:`~testkit.standin.weights.
expected_tokens`); otherwise a ``seed`` (or a random nonce) picks the sample. ``max_tokens`` is
clamped to the context left after the prompt, as vLLM does.

The answer faults (``fail_inference``, ``drop_inference``, ``drop_stream_after``, ``pad_bytes``,
``flood_events``, ``token_ids``, ``weight_versions``: :class:`~testkit.standin.server.Faults`)
and the recording switch (:attr:`~testkit.standin.server.StandinReplica.recorded`) apply here.

Not modelled (accepted and ignored, so a real server would answer differently): ``logprobs``
(always null), ``stop``/``stop_token_ids``/``min_tokens``, ``echo``, tools, beam search,
multimodal content. Streamed chunks may carry several tokens (one chunk per engine tick, not per
token).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2.sandbox
from aiohttp import web
from pydantic import BaseModel, ValidationError

from testkit.standin.engine import EngineDead, SimEngine, SimRequest
from testkit.standin.protocol import (
    ChatBody,
    CompletionBody,
    GenerateBody,
    chat_choice,
    check_cache_salt,
    completion_choice,
    completion_response,
    dumps,
    error,
    generate_choice,
    generate_response,
    json_error,
    not_found_model,
    semantic_error,
    spans_json,
    usage,
    validation_error,
)
from testkit.standin.server import (
    Faults,
    Kind,
    StandinReplica,
    drop,
    generation_engine,
    ok,
    replica_of,
)
from testkit.standin.weights import Tokenizer

__all__ = ["chat_completions", "completions", "generate"]

B = TypeVar("B", bound=BaseModel)
_JINJA = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_NO_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
    "a chat template if the tokenizer does not define one."
)


@dataclass
class Call:
    """One inference HTTP call and the sequences it runs."""

    kind: Kind
    rid: str
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    return_ids: bool
    spans: bool
    created: int = field(default_factory=lambda: int(time.time()))
    requests: list[SimRequest] = field(default_factory=list)


async def completions(request: web.Request) -> web.StreamResponse:
    rep = replica_of(request)
    body = await _parse(request, CompletionBody)
    check_cache_salt(body.cache_salt)
    _check_model(rep, body.model)
    prompts = _completion_prompts(rep, body.prompt)
    spans = rep.caps >= (0, 33, 0) and body.return_weight_versions
    return await _run(
        request,
        rep,
        Call("completion", f"cmpl-{_hex()}", prompts, body.n, bool(body.stream),
             _usage_wanted(body), bool(body.return_token_ids), spans),
        body.max_tokens,
        body,
        body.cache_salt,
    )  # fmt: skip


async def chat_completions(request: web.Request) -> web.StreamResponse:
    rep = replica_of(request)
    body = await _parse(request, ChatBody)
    check_cache_salt(body.cache_salt)
    _check_model(rep, body.model)
    if rep.chat_template is None or rep.tokenizer is None:
        raise semantic_error(_NO_TEMPLATE)
    try:
        text = _JINJA.from_string(rep.chat_template).render(
            messages=[_flatten(m) for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
        )
    except jinja2.TemplateError as e:
        raise semantic_error(str(e)) from e
    spans = rep.caps >= (0, 33, 0) and body.return_weight_versions
    max_tokens = body.max_completion_tokens or body.max_tokens
    return await _run(
        request,
        rep,
        Call("chat", f"chatcmpl-{_hex()}", [rep.tokenizer.encode(text)], body.n,
             bool(body.stream), _usage_wanted(body), bool(body.return_token_ids), spans),
        max_tokens,
        body,
        body.cache_salt,
    )  # fmt: skip


async def generate(request: web.Request) -> web.StreamResponse:
    rep = replica_of(request)
    body = await _parse(request, GenerateBody)
    check_cache_salt(body.cache_salt)
    _check_model(rep, body.model)
    sp = body.sampling_params
    spans = rep.caps >= (0, 32, 0)
    return await _run(
        request,
        rep,
        Call("generate", f"generate-tokens-{_hex()}", [list(body.token_ids)], sp.n,
             bool(body.stream), _usage_wanted(body), bool(body.return_token_ids), spans),
        sp.max_tokens,
        sp,
        body.cache_salt,
    )  # fmt: skip


# ------------------------------------------------------------------------------ parsing


def _hex() -> str:
    return os.urandom(8).hex()


async def _parse(request: web.Request, model: type[B]) -> B:
    """The body as ``model``; recorded, and answered by the inference faults, first."""
    raw = await request.read()
    try:
        data = json.loads(raw)
    except ValueError as e:
        pos = e.pos if isinstance(e, json.JSONDecodeError) else 0
        raise json_error(e, pos) from e
    if not isinstance(data, dict):
        item = {
            "type": "model_attributes_type",
            "loc": "body",
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": f"<{type(data).__name__} of {len(data) if hasattr(data, '__len__') else 0} "
            "items>",
        }
        raise error(400, f"1 validation error:\n  {item}", "Bad Request", "body")
    rep = replica_of(request)
    if rep.recorded is not None:
        rep.recorded.append(data)
    failure = rep.faults.fail_inference
    if failure is not None:
        raise error(failure.status, failure.message, failure.type)
    if rep.faults.drop_inference:
        await drop(request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


def _usage_wanted(body: Any) -> bool:
    options = body.stream_options
    return bool(options is not None and options.include_usage)


def _check_model(rep: StandinReplica, model: str | None) -> None:
    name = rep.config.model_name
    if model is not None and model != name:
        raise not_found_model(model, name)


def _tokenizer(rep: StandinReplica) -> Tokenizer:
    if rep.tokenizer is None:
        raise semantic_error(f"the stand-in's model {rep.model} has no tokenizer.json")
    return rep.tokenizer


def _completion_prompts(rep: StandinReplica, prompt: Any) -> list[list[int]]:
    if prompt is None or prompt == "" or prompt == []:
        raise semantic_error(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    if isinstance(prompt, str):
        return [_tokenizer(rep).encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [_tokenizer(rep).encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _flatten(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return {**message, "content": "\n".join(texts)}
    return message


def _check_prompt(rep: StandinReplica, engine: SimEngine, ids: list[int]) -> None:
    vocab = engine.weights.vocab_size
    bad = [t for t in ids if t < 0 or t >= vocab]
    if bad:
        worst = min(bad) if min(bad) < 0 else max(bad)
        raise semantic_error(f"Token id {worst} is out of vocabulary")
    limit = rep.config.max_model_len
    if len(ids) > limit:
        raise semantic_error(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {len(ids)} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            len(ids),
        )


# ------------------------------------------------------------------------------ running


async def _run(
    request: web.Request,
    rep: StandinReplica,
    call: Call,
    max_tokens: int | None,
    sampling: Any,
    salt: str | None,
) -> web.StreamResponse:
    engine = generation_engine(rep)
    limits = []
    for ids in call.prompts:
        _check_prompt(rep, engine, ids)
        room = rep.config.max_model_len - len(ids)
        limit = room if max_tokens is None else min(max_tokens, room)
        if limit < 1:
            msg = f"max_tokens must be at least 1, got {limit}."
            raise semantic_error(msg, "max_tokens", limit)
        limits.append(limit)
    if engine.pause_mode in ("abort", "wait") and rep.caps >= (0, 33, 0):
        raise error(
            503,
            "Generation is paused. Please retry after it resumes.",
            "ServiceUnavailableError",
        )
    changed = asyncio.Event()
    greedy = sampling.temperature is not None and sampling.temperature <= 1e-5
    for p, (ids, limit) in enumerate(zip(call.prompts, limits, strict=True)):
        for i in range(call.n):
            if greedy:
                nonce = b""
            elif sampling.seed is not None:
                nonce = f"{sampling.seed}:{i}".encode()
            else:
                nonce = os.urandom(8)
            call.requests.append(
                SimRequest(
                    f"{call.rid}-{p * call.n + i}",
                    ids,
                    limit,
                    ignore_eos=sampling.ignore_eos,
                    nonce=nonce,
                    salt=salt,
                    stream=call.stream,
                    changed=changed,
                )
            )
    try:
        engine.submit(call.requests)
        if call.stream:
            return await _stream(request, rep, call, changed)
        return await _whole(request, rep, call, changed)
    finally:
        left = [r for r in call.requests if not r.done]
        if left and not engine.dead:
            engine.abort(left)  # the client went away


async def _whole(
    request: web.Request, rep: StandinReplica, call: Call, changed: asyncio.Event
) -> web.StreamResponse:
    while not all(r.done for r in call.requests):
        await changed.wait()
        changed.clear()
    if any(r.dead for r in call.requests):
        raise EngineDead("the replica died")
    tok = rep.tokenizer
    choices = []
    completion = 0
    for index, r in enumerate(call.requests):
        ids = list(r.tokens)
        completion += len(ids)
        text = tok.stream().step(ids) if tok is not None else ""  # vLLM's incremental text
        spans = r.spans if call.spans else None
        token_ids = ids if call.return_ids else None
        if call.kind == "completion":
            prompt_ids = list(r.prompt) if call.return_ids else None
            choices.append(
                completion_choice(index, text, r.finish_reason, token_ids, prompt_ids, spans)
            )
        elif call.kind == "chat":
            choices.append(chat_choice(index, text, r.finish_reason, token_ids, spans))
        else:
            choices.append(generate_choice(index, r.finish_reason, ids, spans))
    prompt_tokens = sum(len(p) for p in call.prompts)
    name = rep.config.model_name
    if call.kind == "generate":
        prompt_ids = call.prompts[0] if call.return_ids else None
        body = generate_response(
            call.rid, call.created, name, choices, prompt_tokens, completion, prompt_ids
        )
    else:
        body = completion_response(
            call.rid,
            call.created,
            name,
            choices,
            rep.fingerprint,
            prompt_tokens,
            completion,
            chat=call.kind == "chat",
            prompt_ids=call.prompts[0] if call.return_ids and call.kind == "chat" else None,
        )
    faults = rep.faults
    for choice, r in zip(body["choices"], call.requests, strict=True):
        _rig(faults, choice, 0, len(r.tokens), final=True)
    if not faults.pad_bytes:
        return ok(body)
    padded = {**body, "pad": "x" * faults.pad_bytes}
    if not faults.pad_chunked:
        return ok(padded)
    data = dumps(padded).encode()
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)  # no Content-Length: chunked
    for start in range(0, len(data), 512):
        await resp.write(data[start : start + 512])
    await resp.write_eof()
    return resp


def _rig(faults: Faults, choice: dict[str, Any], start: int, end: int, final: bool) -> None:
    """Apply the ``token_ids`` / ``weight_versions`` faults to a choice that carries tokens
    ``start:end`` of its sequence (``final``: and its end)."""
    if faults.token_ids is not None:
        choice["token_ids"] = list(faults.token_ids[start:end])
    if final and faults.weight_versions is not None:
        choice["weight_versions"] = list(faults.weight_versions)


#: the choice of a ``flood_events`` event: 64 KiB of text
_FLOOD = {"index": 0, "text": "x" * 65536}


class _Choice:
    """What one streamed choice has sent so far."""

    __slots__ = ("detok", "final", "sent", "started")

    def __init__(self, tok: Tokenizer | None) -> None:
        self.sent = 0
        self.started = False
        self.final = False
        self.detok = tok.stream() if tok is not None else None


async def _stream(
    request: web.Request, rep: StandinReplica, call: Call, changed: asyncio.Event
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    if rep.faults.flood_events:
        flood = f"data: {dumps({'id': call.rid, 'choices': [_FLOOD]})}\n\n".encode()
        for _ in range(rep.faults.flood_events):
            await resp.write(flood)
    per_token = rep.config.stream_per_token
    written = 0
    state = [_Choice(rep.tokenizer) for _ in call.requests]
    while not all(s.final for s in state):
        await changed.wait()
        changed.clear()
        if any(r.dead for r in call.requests):
            raise EngineDead("the replica died")
        events = []
        for index, (r, s) in enumerate(zip(call.requests, state, strict=True)):
            new = r.tokens[s.sent :]
            finish = r.finish_reason
            if s.final or (not new and finish is None):
                continue
            pieces = [[t] for t in new] if per_token and len(new) > 1 else [new]
            for n, piece in enumerate(pieces):
                last = n == len(pieces) - 1
                s.sent += len(piece)
                s.final = last and finish is not None
                events += _chunks(rep, call, index, r, s, piece, finish if last else None)
        cut = rep.faults.drop_stream_after
        if cut is not None and written + len(events) >= cut:
            await resp.write("".join(f"data: {e}\n\n" for e in events[: cut - written]).encode())
            await drop(request)
        written += len(events)
        if per_token:
            for e in events:
                await resp.write(f"data: {e}\n\n".encode())
        elif events:
            await resp.write("".join(f"data: {e}\n\n" for e in events).encode())
    tail = []
    if call.include_usage:
        completion = sum(len(r.tokens) for r in call.requests)
        tail.append(dumps(_usage_chunk(rep, call, completion)))
    tail.append("[DONE]")
    await resp.write("".join(f"data: {e}\n\n" for e in tail).encode())
    await resp.write_eof()
    return resp


def _chunks(
    rep: StandinReplica,
    call: Call,
    index: int,
    r: SimRequest,
    s: _Choice,
    new: list[int],
    finish: str | None,
) -> list[str]:
    """The SSE payloads for ``new`` tokens of one choice (and its end, if ``finish``).

    As in vLLM, a completion or chat choice that ends without ever producing a token (aborted
    while queued) sends no choice chunk (chat still sends its role chunk); generate always does.
    """
    first = not s.started
    s.started = True
    silent = s.sent == 0
    ids = new if call.return_ids else None
    head: dict[str, Any] = {"id": call.rid, "object": "", "created": call.created}
    head["model"] = rep.config.model_name
    stamp = finish is not None and not call.include_usage
    text = s.detok.step(new) if s.detok is not None else ""
    start, final = s.sent - len(new), finish is not None
    if call.kind == "generate":
        choice = generate_choice(index, finish, new, r.spans if finish and call.spans else None)
        _rig(rep.faults, choice, start, s.sent, final)
        chunk: dict[str, Any] = {"request_id": call.rid, "usage": None, "output_mode": "tokens"}
        if first and call.return_ids:
            chunk["prompt_token_ids"] = list(r.prompt)
        chunk["choices"] = [choice]
        return [dumps(chunk)]
    if call.kind == "completion":
        if silent:
            return []
        head["object"] = "text_completion"
        choice = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": list(r.prompt) if first and call.return_ids else None,
            "token_ids": ids,
        }
        if finish is not None and call.spans:
            choice["weight_versions"] = spans_json(r.spans)
        _rig(rep.faults, choice, start, s.sent, final)
        chunk = {**head, "choices": [choice]}
        if stamp:
            chunk["system_fingerprint"] = rep.fingerprint
        return [dumps(chunk)]
    head["object"] = "chat.completion.chunk"
    out = []
    if first:
        role = {"index": index, "delta": {"role": "assistant", "content": ""}}
        role.update(logprobs=None, finish_reason=None)
        prompt_ids = list(r.prompt) if call.return_ids else None
        out.append(dumps({**head, "choices": [role], "prompt_token_ids": prompt_ids,
                          "prompt_text": None}))  # fmt: skip
    if silent:
        return out
    choice = {"index": index, "delta": {"content": text}, "logprobs": None}
    choice["finish_reason"] = finish
    if finish is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = ids
    if finish is not None and call.spans:
        choice["weight_versions"] = spans_json(r.spans)
    _rig(rep.faults, choice, start, s.sent, final)
    chunk = {**head, "choices": [choice]}
    if stamp:
        chunk["system_fingerprint"] = rep.fingerprint
    out.append(dumps(chunk))
    return out


def _usage_chunk(rep: StandinReplica, call: Call, completion: int) -> dict[str, Any]:
    prompt = sum(len(p) for p in call.prompts)
    if call.kind == "generate":
        u = usage(prompt, completion, details=False)
        return {"request_id": call.rid, "usage": u, "output_mode": "tokens", "choices": []}
    kind = "text_completion" if call.kind == "completion" else "chat.completion.chunk"
    return {
        "id": call.rid,
        "object": kind,
        "created": call.created,
        "model": rep.config.model_name,
        "choices": [],
        "usage": usage(prompt, completion, details=False),
        "system_fingerprint": rep.fingerprint,
    }
