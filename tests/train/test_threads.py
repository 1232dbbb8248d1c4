"""The trainer picks its torch threads per phase instead of inheriting whatever count the thread
pool's workers were born with (the engine thread's 1, on this machine)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest
import torch

from relayrl.config import RelayConfig
from relayrl.errors import ConfigError
from relayrl.train import trainer
from relayrl.train.config import TrainConfig


@dataclass
class Services:
    engine_threads: int


@pytest.mark.parametrize(("cores", "engine", "setting", "sft", "rl"), [
    (2, 1, None, 2, 1),    # this machine: the engine's core is left to it during RL
    (16, 15, None, 16, 1),
    (16, 4, None, 16, 12),
    (2, 0, None, 2, 2),    # an engine served elsewhere
    (2, 8, None, 2, 1),    # never fewer than one
    (2, 1, 3, 3, 3),       # train.num_threads wins
])
def test_threads_per_phase(monkeypatch: pytest.MonkeyPatch, cores: int, engine: int,
                           setting: int | None, sft: int, rl: int) -> None:
    monkeypatch.setattr(trainer, "usable_cores", lambda: cores)
    cfg = RelayConfig(train=TrainConfig(num_threads=setting))
    run = trainer._Run(cfg, actor=None, services=Services(engine))  # type: ignore[arg-type]
    assert (run.threads("sft"), run.threads("rl")) == (sft, rl)


def test_a_worker_born_after_another_thread_set_one_gets_what_it_asks_for() -> None:
    before = torch.get_num_threads()
    try:
        setter = threading.Thread(target=torch.set_num_threads, args=(1,))
        setter.start()
        setter.join()

        async def in_worker(threads: int | None) -> int:
            if threads is None:
                return await asyncio.to_thread(torch.get_num_threads)
            return await asyncio.to_thread(trainer._in_threads, threads, torch.get_num_threads)

        async def both() -> tuple[int, int]:
            return await in_worker(None), await in_worker(2)

        inherited, asked = asyncio.run(both())
    finally:
        torch.set_num_threads(before)
    assert inherited == 1  # what the trainer's updates ran on before it asked
    assert asked == 2


def test_num_threads_below_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="num_threads"):
        TrainConfig(num_threads=0)


def test_engine_threads_count_in_process_engines_only(model_dir: str) -> None:
    from relayrl.engine.fake import FakeEngine
    from relayrl.launch.replicas import AllEngines, engine_threads

    @dataclass
    class Local:
        num_threads: int

    assert engine_threads(FakeEngine(["x"], tokenizer_path=model_dir)) == 0
    assert engine_threads(Local(1)) == 1  # type: ignore[arg-type]
    assert engine_threads(AllEngines([Local(1), Local(2)])) == 3  # type: ignore[list-item]


def test_every_update_of_a_run_runs_on_one_thread_with_its_phases_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # glibc keeps a thread's freed blocks in that thread's arena: updates hopping between pool
    # workers each left an update's worth of memory behind, so a run uses one update thread.
    monkeypatch.setattr(trainer, "usable_cores", lambda: 2)
    run = trainer._Run(RelayConfig(), actor=None, services=Services(1))  # type: ignore[arg-type]
    before = torch.get_num_threads()

    def where() -> tuple[int, int]:
        return threading.get_ident(), torch.get_num_threads()

    async def phases() -> list[tuple[int, int]]:
        # other work on the default pool keeps its workers busy meanwhile
        busy = [asyncio.to_thread(threading.Event().wait, 0.05) for _ in range(4)]
        seen = [await run.off_loop("sft", where)]
        seen += await asyncio.gather(*(run.off_loop("rl", where) for _ in range(4)), *busy)
        return seen[:5]

    try:
        seen = asyncio.run(phases())
    finally:
        run.update_thread.shutdown(wait=True)
        torch.set_num_threads(before)
    assert len({ident for ident, _ in seen}) == 1
    assert threading.get_ident() not in {ident for ident, _ in seen}
    assert [n for _, n in seen] == [2, 1, 1, 1, 1]


def test_an_eval_gives_the_engine_the_update_cores_and_hands_them_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer, "usable_cores", lambda: 2)

    class Engine:
        num_threads = 1

        def __init__(self) -> None:
            self.asked: list[int | None] = []

        def set_threads(self, threads: int | None) -> None:
            self.asked.append(threads)

    @dataclass
    class WithEngine:
        engine: Engine
        engine_threads: int = 1

    engine = Engine()
    run = trainer._Run(RelayConfig(), actor=None, services=WithEngine(engine))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError), run._engine_takes_update_cores():
        assert engine.asked == [2]
        raise RuntimeError("an eval that fails still hands the cores back")
    assert engine.asked == [2, None]
    # an engine without the knob (a server elsewhere, replicas) is left alone
    elsewhere = trainer._Run(RelayConfig(), actor=None,  # type: ignore[arg-type]
                             services=WithEngine(object(), 0))  # type: ignore[arg-type]
    with elsewhere._engine_takes_update_cores():
        pass


def test_an_update_follows_the_threads_it_is_lent_at_each_layer_forward_and_backward(
        tiny_llama_dir: str) -> None:
    from relayrl.train.actor import Actor
    from tests.train.test_actor import signed_batch

    actor = Actor(tiny_llama_dir, TrainConfig(bf16=False))
    batch, adv = signed_batch(actor)
    layers = actor.compute_model.get_decoder().layers
    seen: list[tuple[str, int]] = []
    layers[0].register_forward_hook(lambda *_: seen.append(("forward", torch.get_num_threads())))
    # the first layer's backward runs last: the count was set again by layer 1's backward hook
    layers[0].register_full_backward_hook(
        lambda *_: seen.append(("backward", torch.get_num_threads())))

    def update(wanted: int | None, lent_in_backward: int | None = None) -> None:
        actor.threads_wanted = wanted
        if lent_in_backward is not None:  # lent mid-update: after the forward, before backward
            layers[-1].register_forward_hook(
                lambda *_: setattr(actor, "threads_wanted", lent_in_backward))
        actor.update(batch, adv)

    def on_a_worker(*steps: tuple[int | None, int | None]) -> None:
        torch.set_num_threads(1)
        for wanted, later in steps:
            update(wanted, later)

    worker = threading.Thread(target=on_a_worker, args=((None, None), (2, None), (1, 2)))
    worker.start()
    worker.join()
    assert seen == [("forward", 1), ("backward", 1), ("forward", 2), ("backward", 2),
                    ("forward", 1), ("backward", 2)]


async def test_the_update_takes_the_engines_cores_once_no_rollout_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer, "usable_cores", lambda: 2)

    class Actor:
        threads_wanted: int | None = None

    @dataclass
    class Engine:
        active: int = 0

    @dataclass
    class WithEngine:
        engine: Engine
        engine_threads: int = 1

    actor, engine, running = Actor(), Engine(active=1), [3]
    run = trainer._Run(RelayConfig(), actor=actor, services=WithEngine(engine))  # type: ignore[arg-type]
    seen = []
    async with run._lend_idle_engine_cores(lambda: running[0]) as lent:
        for state in ((3, 1), (0, 1), (0, 0), (2, 0), (0, 0)):  # (episodes in flight, engine)
            running[0], engine.active = state
            await asyncio.sleep(0.12)
            seen.append(actor.threads_wanted)
    assert seen == [1, 1, 2, 1, 2]  # both idle: its own core and the engine's
    assert actor.threads_wanted is None  # the next phase picks its own again
    assert 0.15 < lent.seconds < 0.4
    # a service's agents may call the engine at any time: no knowledge of rollouts, no lending
    async with run._lend_idle_engine_cores(None) as lent:
        assert actor.threads_wanted is None
    assert lent.seconds == 0
