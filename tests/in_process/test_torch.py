"""The torch backend's checks that need no second process, and encoding properties."""

from __future__ import annotations

import runpy
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")
numpy = pytest.importorskip("numpy", reason="numpy is needed by torch's tensor.numpy()")

from metrale_model_engine import (  # noqa: E402
    U32_MAX,
    EpCommandRefused,
    EpLink,
    SequenceState,
    WorkerSummary,
    as_u32_buffer,
)
from metrale_model_engine import torch as ep_torch  # noqa: E402
from metrale_model_engine._launch import groups  # noqa: E402
from metrale_model_engine._launch.groups import LOWEST_CHOSEN_PORT, await_listener  # noqa: E402
from metrale_model_engine._torch import severing  # noqa: E402
from metrale_model_engine.testing import RecordingEp, ReplayTransport  # noqa: E402
from metrale_model_engine.torch import TorchTransport, init_local_group, run_group, tensor_tokens  # noqa: E402

pytestmark = pytest.mark.torch

u32 = st.integers(min_value=0, max_value=U32_MAX)


def test_transport_needs_an_initialised_group() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        TorchTransport()


def test_local_group_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"rank=2 is out of range for world_size=2 \(0 \.\.= 1\)"):
        init_local_group(2, 2, port=1)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got int 0"):
        run_group(print, 0)
    with pytest.raises(TypeError, match=r"world_size must be an int >= 1, got str '2'"):
        run_group(print, "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0 or None, got int 0"):
        run_group(print, 1, timeout=0)
    with pytest.raises(TypeError, match=r"timeout must be a finite number of seconds > 0 or None, got str '5'"):
        run_group(print, 1, timeout="5")  # type: ignore[arg-type]


def test_import_without_torch_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import metrale_model_engine.torch\n"
        "except ImportError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, then the 'torch' extra" in (
        result.stdout
    )


def test_import_without_numpy_names_numpy() -> None:
    code = "import sys; sys.modules['numpy'] = None\nimport metrale_model_engine.torch"
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: metrale_model_engine.torch needs numpy"), result.stderr[-1000:]


def test_demo_without_torch_says_which_extra_to_install() -> None:
    code = "import sys; sys.modules['torch'] = None\nfrom metrale_model_engine.demo import main\nsys.exit(main([]))"
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: metrale_model_engine.torch needs PyTorch") and "then the 'torch' extra" in line


@given(st.lists(u32, min_size=1, max_size=300))
def test_token_tensor_round_trips(tokens: list[int]) -> None:
    words = tensor_tokens(torch.tensor(tokens, dtype=torch.int64))
    assert memoryview(words).tolist() == tokens


@given(st.lists(st.integers(min_value=-(2**40), max_value=2**40), min_size=1, max_size=50))
def test_out_of_range_tokens_are_always_refused(tokens: list[int]) -> None:
    bad = [t for t in tokens if not 0 <= t <= U32_MAX]
    if bad:
        with pytest.raises(ValueError, match=rf"tokens\[{tokens.index(bad[0])}\]={bad[0]} is outside"):
            as_u32_buffer("tokens", tokens)
        with pytest.raises(ValueError, match=rf"tokens\[{tokens.index(bad[0])}\]={bad[0]} is outside"):
            tensor_tokens(torch.tensor(tokens, dtype=torch.int64))
    else:
        assert memoryview(as_u32_buffer("tokens", tokens)).tolist() == tokens


def test_composes_with_nn_module() -> None:
    from torch import nn

    from metrale_model_engine import ModelEp

    class TinyLm(nn.Module, ModelEp):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    model = TinyLm()
    assert model.is_ep() is False and model.ep_broadcast_tokens([1, 2]) == []
    assert [name for name, _ in model.named_parameters()] == ["proj.weight", "proj.bias"]
    with pytest.raises(ValueError, match=r"cmd=-1 is outside"):
        model.ep_broadcast_cmd(-1)


def test_a_linked_model_beside_nn_module_hands_its_collective_commands_to_the_link() -> None:
    from torch import nn

    from metrale_model_engine import LinkedEp, RunStopped
    from metrale_model_engine.transport import SoloTransport

    from helpers.pair import LinkPair

    forward = 7

    class Summing(nn.Module, LinkedEp[SequenceState]):
        ep_collective_commands = frozenset({forward})

        def __init__(self, link: EpLink) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.ep_link = link  # through nn.Module.__setattr__, then LinkedEp's

    pair = LinkPair(collective={forward})
    model = Summing(pair.head)
    assert model.ep_link is pair.head and [name for name, _ in model.named_parameters()] == ["proj.weight", "proj.bias"]
    model.ep_link.send_command(0, forward)  # the head's forward skipped: owed, since the model declared the word
    with pytest.raises(RunStopped, match=r"the head reached a sync point without running its forward: .*declares it"):
        model.ep_link.sync()
    model.ep_link = EpLink(SoloTransport(), num_slots=4)  # one rank: nothing is owed
    model.ep_link.send_command(0, forward)
    model.ep_link.send_command(0, forward)
    assert model.ep_link.stopped is None


def test_torch_ep_was_replaced_and_says_by_what() -> None:
    with pytest.raises(
        AttributeError, match=r"TorchEp was replaced: subclass LinkedEp and hold the link that open_link"
    ):
        getattr(ep_torch, "TorchEp")  # noqa: B009


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_is_a_clear_error() -> None:
    from metrale_model_engine.torch import free_port, init_local_group

    with pytest.raises(RuntimeError, match=r"backend 'nccl' needs a CUDA device, and this machine has none"):
        init_local_group(0, 1, port=free_port(), backend="nccl")


def test_open_transport_checks_the_kind_before_touching_the_group() -> None:
    with pytest.raises(ValueError, match=r"transport must be one of 'auto', 'shm', 'torch', got str 'gloo'"):
        ep_torch.open_transport("gloo")
    with pytest.raises(TypeError, match=r"transport must be one of 'auto', 'shm', 'torch', got int 1"):
        ep_torch.open_transport(1)  # type: ignore[arg-type]


def test_the_readmes_model_replays_a_recording_its_collectives_with_one_participant() -> None:
    """The README's recipe for a scheduler's tests, on the README's model: ``Collectives`` on a replay link."""
    example = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "ep_model.py"))
    head: RecordingEp[SequenceState] = RecordingEp(num_slots=4)
    head.ep_link.send_command(0, example["OPEN"])
    head.ep_link.send_command(0, example["FORWARD"], [65, 97])
    worker = example["TensorParallelMlp"](EpLink(ReplayTransport(()), num_slots=4))  # no process group
    slots: list[SequenceState | None] = [None] * 4
    assert head.replay(worker, slots) == WorkerSummary(commands_run=2, commands_failed=0)
    assert slots[0] == SequenceState(0, [65, 97])
    forgot = type("Forgot", (example["TensorParallelMlp"],), {"ep_collective_commands": frozenset()})
    with pytest.raises(EpCommandRefused, match=r"an all-reduce ran in cmd 2, which ep_collective_commands does not"):
        head.replay(forgot(EpLink(ReplayTransport(()), num_slots=4)), [None] * 4)


def test_free_port_picks_below_the_kernels_ephemeral_range_a_port_that_binds() -> None:
    """Below the range outgoing connections take their ports from (when the kernel says where it begins)."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral = int(ranges.read_text().split()[0]) if ranges.exists() else 0
    if ephemeral <= LOWEST_CHOSEN_PORT:
        pytest.skip(f"needs an ephemeral range above port {LOWEST_CHOSEN_PORT} (this one begins at {ephemeral or '?'})")
    for _ in range(20):
        port = ep_torch.free_port()
        assert LOWEST_CHOSEN_PORT <= port < ephemeral
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", port))


def test_a_rank_goes_on_once_rank_0_listens_and_not_before() -> None:
    """Well inside torch's 0.3-0.7 s backoff after a refused connect, which a group's start would wait otherwise."""
    port = ep_torch.free_port()
    listening: list[float] = []

    def listen_late(listener: socket.socket) -> None:
        time.sleep(0.2)
        listening.append(time.monotonic())  # before the listen: the wait may end before this thread runs again
        listener.listen()

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", port))  # bound, not listening: a connect is refused
        late = threading.Thread(target=listen_late, args=(listener,))
        late.start()
        assert await_listener(port, limit=10.0)
        answered = time.monotonic()
        late.join()
    assert listening[0] <= answered < listening[0] + 0.25


def test_a_rank_that_cannot_read_the_kernels_sockets_waits_for_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(*arguments: object, **options: object) -> None:
        raise FileNotFoundError("/proc/self/net/tcp")

    monkeypatch.setattr(severing, "open", no_proc, raising=False)
    started = time.monotonic()
    assert await_listener(ep_torch.free_port(), limit=10.0)
    assert time.monotonic() - started < 1.0


def test_a_rank_waits_for_rank_0_no_longer_than_its_limit() -> None:
    port = ep_torch.free_port()
    started = time.monotonic()
    assert not await_listener(port, limit=0.1)
    assert 0.1 <= time.monotonic() - started < 5.0


def awaits_recorded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ports the ranks set up from now on wait for a listener on (none joins a group): a list that fills."""
    calls: list[int] = []

    def record(port: int) -> bool:
        calls.append(port)
        return True

    monkeypatch.setattr(groups, "await_listener", record)
    monkeypatch.setattr(groups, "_init_group", lambda *arguments: None)
    return calls


@pytest.mark.parametrize(
    ("env", "awaited"),
    [
        ({"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, [29511]),
        ({"RANK": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29511"}, [29511]),
        ({"RANK": "1", "MASTER_ADDR": "::1", "MASTER_PORT": "29511"}, [29511]),
        ({"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, []),  # rank 0 starts the store
        ({"RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}, []),  # another host's socket: unseen
        ({"RANK": "1", "MASTER_ADDR": "head-node", "MASTER_PORT": "29511"}, []),  # a name: no resolver asked
        ({"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_USE_AGENT_STORE": "True"}, []),
        ({"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"}, []),  # torch's own error says what is wrong
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, []),
    ],
    ids=[
        "worker",
        "localhost",
        "ipv6-loopback",
        "rank-0",
        "other-host",
        "a-name",
        "torchrun-agent",
        "bad-port",
        "no-rank",
    ],
)
def test_a_group_from_the_environment_waits_for_rank_0s_store_where_rank_0_starts_it(
    env: dict[str, str], awaited: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = awaits_recorded(monkeypatch)
    ep_torch.init_group_from_env()
    assert calls == awaited


@pytest.mark.parametrize(("rank", "awaited"), [(0, []), (1, [29512])])
def test_a_local_group_waits_for_rank_0s_store_on_every_other_rank(
    rank: int, awaited: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = awaits_recorded(monkeypatch)
    init_local_group(rank, 2, port=29512)
    assert calls == awaited
