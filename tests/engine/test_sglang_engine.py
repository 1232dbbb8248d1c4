"""`SGLangEngine`'s request/response handling against a loopback stub of SGLang's native API.

SGLang has no CPU wheel that runs here, so these tests check the client against the shapes SGLang
documents (io_struct.py's GenerateReqInput / meta_info, http_server.py's routes): what the engine
sends, and how it reads cumulative and incremental streams, finish reasons, aborts and weight
updates. The same contract tests as tests/engine/test_vllm_engine.py need a real SGLang server on
a GPU (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from relayrl.engine.sglang import SGLangEngine
from relayrl.errors import EngineError, InvalidRequest
from relayrl.types import FinishReason, GenerateRequest, SamplingParams

REPLY = [101, 102, 103, 104, 105, 106]


def logprob_of(position: int) -> float:
    return -0.1 * (position + 1)


@dataclass
class Stub:
    """State of the fake SGLang server: what it received, and how it streams."""

    incremental: bool = False
    token_delay_s: float = 0.0
    bodies: list[dict] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    fail_generate: int | None = None


def build_app(stub: Stub, model_dir: Path) -> FastAPI:
    app = FastAPI()

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": str(model_dir), "is_generation": True}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        stub.bodies.append(body)
        stub.calls.append("generate")
        if stub.fail_generate is not None:
            return JSONResponse({"error": {"message": "bad input"}}, status_code=stub.fail_generate)
        sp = body["sampling_params"]
        rid = body["rid"]

        async def events():
            out: list[int] = []
            for token in REPLY[: sp["max_new_tokens"]]:
                await asyncio.sleep(stub.token_delay_s)
                if rid in stub.aborted:
                    meta = {"completion_tokens": len(out), "output_token_logprobs": [],
                            "finish_reason": {"type": "abort", "message": "aborted"}}
                    yield f"data: {json.dumps({'output_ids': [], 'meta_info': meta})}\n\n"
                    break
                out.append(token)
                finish = None
                if token in sp.get("stop_token_ids", []):
                    finish = {"type": "stop", "matched": token}
                elif token == 104 and sp.get("stop"):
                    finish = {"type": "stop", "matched": sp["stop"][0]}
                elif len(out) == sp["max_new_tokens"] or len(out) == len(REPLY):
                    finish = {"type": "length", "length": len(out)}
                triples = [[logprob_of(j), t, None] for j, t in enumerate(out)]
                tops = [[[logprob_of(j), t, None], [logprob_of(j) - 1, t + 1, None]]
                        for j, t in enumerate(out)]
                if stub.incremental:
                    ids, triples, tops = [token], triples[-1:], tops[-1:]
                else:
                    ids = list(out)
                meta = {"id": rid, "completion_tokens": len(out), "finish_reason": finish,
                        "output_token_logprobs": triples, "output_top_logprobs": tops,
                        "weight_version": "default"}
                yield f"data: {json.dumps({'output_ids': ids, 'meta_info': meta})}\n\n"
                if finish is not None:
                    break
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        stub.aborted.add((await request.json())["rid"])
        stub.calls.append("abort_request")
        return JSONResponse({})

    for route in ("pause_generation", "continue_generation", "update_weights_from_disk"):

        async def handler(request: Request, route: str = route):
            body = await request.json()
            stub.bodies.append(body)
            stub.calls.append(route)
            if route == "update_weights_from_disk":
                ok = Path(body["model_path"], "model.safetensors").is_file()
                return {"success": ok, "message": "" if ok else "no weights"}
            return {"status": "ok"}

        app.post(f"/{route}")(handler)
    return app


@pytest.fixture
def stub(model_dir: str) -> Iterator[tuple[Stub, str]]:
    state = Stub()
    server = uvicorn.Server(uvicorn.Config(build_app(state, Path(model_dir)), host="127.0.0.1",
                                           port=0, log_level="warning"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield state, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def req(n: int = 6, **kw) -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=n, **kw))


@pytest.mark.parametrize("incremental", [False, True])
def test_streams_tokens_logprobs_and_versions_from_either_stream_mode(stub, incremental):
    state, url = stub
    state.incremental = incremental
    engine = SGLangEngine(url)
    assert engine.context_length == 8192  # max_position_embeddings of the default model

    async def collect():
        return [c async for c in engine.stream(req(6, top_logprobs=2))]

    chunks = asyncio.run(collect())
    assert [c.ids for c in chunks] == [[t] for t in REPLY]
    assert [x for c in chunks for x in c.logprobs] == pytest.approx(
        [logprob_of(i) for i in range(6)])
    assert all(c.versions == [0] for c in chunks)
    assert chunks[-1].finish_reason == FinishReason.LENGTH
    tops = [t for c in chunks for t in (c.top_logprobs or [])]
    assert [[x.token_id for x in t] for t in tops] == [[t, t + 1] for t in REPLY]


def test_sends_the_documented_generate_fields(stub):
    state, url = stub
    engine = SGLangEngine(url)
    request = req(4, temperature=0.7, top_p=0.9, stop_token_ids=(2,), stop=("x",), seed=3)
    asyncio.run(engine.generate(request))
    body = state.bodies[-1]
    assert body["input_ids"] == [1, 2, 3] and body["rid"] == request.request_id
    assert body["return_logprob"] is True and body["stream"] is True
    assert body["logprob_start_len"] == -1 and body["top_logprobs_num"] == 0
    sp = body["sampling_params"]
    assert sp == {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                  "stop_token_ids": [2], "stop": ["x"], "ignore_eos": True,
                  "skip_special_tokens": False, "no_stop_trim": True, "sampling_seed": 3}


def test_finish_reasons_stop_id_stop_string_and_length(stub):
    _, url = stub
    engine = SGLangEngine(url)
    by_id = asyncio.run(engine.generate(req(6, stop_token_ids=(103,))))
    assert by_id.output_ids == REPLY[:3] and by_id.finish_reason == FinishReason.STOP
    assert by_id.stop_string is None
    by_text = asyncio.run(engine.generate(req(6, stop=("four",))))
    assert by_text.output_ids == REPLY[:4] and by_text.stop_string == "four"
    short = asyncio.run(engine.generate(req(2)))
    assert short.output_ids == REPLY[:2] and short.finish_reason == FinishReason.LENGTH


def test_abort_ends_the_stream_with_abort(stub):
    state, url = stub
    state.token_delay_s = 0.05
    engine = SGLangEngine(url)
    request = req(6)

    async def scenario():
        got = []
        async for chunk in engine.stream(request):
            got.append(chunk)
            if len(got) == 1:
                await engine.abort(request.request_id)
        return got

    chunks = asyncio.run(scenario())
    assert chunks[-1].finish_reason == FinishReason.ABORT
    assert sum(len(c.ids) for c in chunks) < len(REPLY)
    assert "abort_request" in state.calls


def test_weight_update_pauses_loads_continues_and_bumps_the_version(stub, tmp_path):
    state, url = stub
    engine = SGLangEngine(url)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"stub")
    assert asyncio.run(engine.update_weights(str(ckpt))) == 1
    assert state.calls[-3:] == ["pause_generation", "update_weights_from_disk",
                                "continue_generation"]
    pause, update = state.bodies[-3], state.bodies[-2]
    assert pause == {"mode": "retract"}
    assert update == {"model_path": str(ckpt.resolve()), "weight_version": "1",
                      "flush_cache": True}
    out = asyncio.run(engine.generate(req(2)))
    assert out.versions == [1, 1]
    # A failed load still continues generation and leaves the version alone.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EngineError, match="no weights"):
        asyncio.run(engine.update_weights(str(empty)))
    assert state.calls[-1] == "continue_generation" and engine.version == 1
    with pytest.raises(InvalidRequest):
        asyncio.run(engine.update_weights(str(tmp_path / "missing")))


def test_server_errors_map_to_relayrl_errors(stub):
    state, url = stub
    engine = SGLangEngine(url)
    state.fail_generate = 400
    with pytest.raises(InvalidRequest, match="bad input"):
        asyncio.run(engine.generate(req(2)))
    state.fail_generate = 500
    with pytest.raises(EngineError):
        asyncio.run(engine.generate(req(2)))
    with pytest.raises(InvalidRequest):
        engine.stream(GenerateRequest([], SamplingParams()))
    with pytest.raises(EngineError, match="cannot reach"):
        SGLangEngine("http://127.0.0.1:9")
