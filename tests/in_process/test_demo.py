"""The demo's refusals before any rank starts, and its choices, in this process (``demo.main``)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine._demo import launch
from metrale_model_engine._demo.launch import recovered_ranks, verdict
from metrale_model_engine.demo import main, parse_args
from metrale_model_engine.reference import Checkpoint, Recovery
from metrale_model_engine.reform import LostRank

from helpers.demo_env import leave_torchrun

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def not_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo as started by hand: none of torchrun's variables (the test process may run under it)."""
    leave_torchrun(monkeypatch)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--world-size", "0"), "argument --world-size: must be at least 1, got 0"),
        (("--slots", "many"), "argument --slots: must be a whole number, got 'many'"),
        (("--prompt-ids", "1,x"), "argument --prompt-ids: a comma-separated list of token ids; an id must be a whole"),
        (("--temperature", "-1"), "argument --temperature: must be in [0, 1e+06], got -1"),
        (("--top-p", "0"), "argument --top-p: must be in (0, 1], got 0"),
        (("--top-k", "-2"), "argument --top-k: must be at least 0, got -2"),
        (("--seed", "x"), "argument --seed: must be a whole number, got 'x'"),
        (("--dtype", "int8"), "argument --dtype: invalid choice: 'int8'"),
        (("--world-size", "65"), "argument --world-size: must be at most 64 (the most ranks one ring serves)"),
        (("--transport", "tcp"), "argument --transport: invalid choice: 'tcp'"),
        (("--json", "/nonexistent/x.json"), "argument --json: '/nonexistent/x.json' is in a directory that does not"),
        (("--json", "/tmp"), "argument --json: '/tmp' is a directory; name a file to write"),
        (("--slots", "4294967296"), "argument --slots: must be at most 4294967295, got 4294967296"),
        (
            ("--kv-memory", "64MB"),
            "argument --kv-memory: must be bytes (67108864, 64MiB, 2GiB) or a fraction of the "
            "free memory in (0, 1] (0.8), got '64MB'",
        ),
        (("--kv-memory", "2.5"), "argument --kv-memory: a fraction of the free memory must be in (0, 1], got '2.5'"),
        (("--kv-memory", "0"), "argument --kv-memory: must be at least 1 byte, got '0'"),
        (("--kv-memory", "0.0"), "argument --kv-memory: a fraction of the free memory must be in (0, 1], got '0.0'"),
        (("--block-size", "0"), "argument --block-size: must be at least 1, got 0"),
    ],
)
def test_demo_refuses_bad_arguments(args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """(``tests/programs/test_demo.py`` runs one of these as ``python -m``: the same line, exit 2.)"""
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, "")
    (line,) = err.splitlines()  # one line, no usage block, no traceback
    assert line.startswith(f"error: {message}") and line.endswith(" (--help lists the options)")


def test_demo_refuses_a_bad_protocol_variable_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("METRALE_EP_PROTOCOL", "garbage")
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "error: METRALE_EP_PROTOCOL='garbage' is not a protocol version; accepted: 'v1', 'v2' (or unset/empty for 'v1')"
    ]


@pytest.mark.parametrize(
    ("devices", "args", "message"),
    [
        (
            0,
            ("--backend", "nccl"),
            "--backend nccl needs a CUDA device per local rank: 2 rank(s), 0 CUDA devices on this machine; "
            "use --backend gloo",
        ),
        (
            1,
            ("--backend", "nccl"),
            "--backend nccl needs a CUDA device per local rank: 2 rank(s), 1 CUDA device on "
            "this machine; use --world-size 1 or --backend gloo",
        ),
        (
            1,
            ("--device", "cuda", "--world-size", "4"),
            "--device cuda needs a CUDA device per local rank: 4 rank(s), "
            "1 CUDA device on this machine; use --world-size 1 or --device cpu",
        ),
        (
            0,
            ("--world-size", "1", "--device", "cuda"),
            "--device cuda needs a CUDA device per local rank: 1 rank(s), "
            "0 CUDA devices on this machine; use --device cpu",
        ),
        (
            2,
            ("--device", "cpu", "--backend", "nccl"),
            "--backend nccl all-reduces CUDA tensors: it needs --device cuda; use --backend gloo",
        ),
        (
            0,
            ("--cuda-graphs",),
            "--cuda-graphs needs --device cuda (the model is on the CPU here, with 0 CUDA devices)",
        ),
        (4, ("--cuda-graphs", "--world-size", "2", "--device", "cpu"), "--cuda-graphs needs --device cuda"),
        (
            4,
            ("--cuda-graphs", "--world-size", "2"),
            "--cuda-graphs is for one rank (a replayed all-reduce could not be bounded by the collective timeout); "
            "use --world-size 1",
        ),
    ],
)
def test_demo_refuses_a_device_it_lacks_before_any_rank_starts(
    devices: int,
    args: tuple[str, ...],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    assert main(list(args)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err


def test_the_device_defaults_to_a_gpu_per_rank_else_the_cpu() -> None:
    from metrale_model_engine._demo.choices import device_and_backend

    for devices, ranks, expected in ((0, 1, "cpu"), (1, 1, "cuda"), (1, 2, "cpu"), (2, 2, "cuda"), (8, 4, "cuda")):
        args = parse_args(["--world-size", str(ranks)])
        chosen = device_and_backend(args, ranks, devices, [1, 2, 4])
        assert chosen == (expected, "nccl" if expected == "cuda" else "gloo")
    assert device_and_backend(parse_args(["--device", "cuda", "--backend", "gloo"]), 2, 2, [1, 2]) == ("cuda", "gloo")
    assert device_and_backend(parse_args(["--backend", "gloo"]), 2, 2, [1, 2]) == ("cpu", "gloo")  # gloo: a CPU model


def test_the_kv_memory_is_bytes_or_a_fraction_and_each_local_rank_has_its_part_of_a_hosts(
    shipped: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from metrale_model_engine._demo.choices import kv_memory
    from metrale_model_engine.reference.rank import pool

    given = {text: parse_args(["--kv-memory", text]).kv_memory for text in ("67108864", "64MiB", "1.5GiB", "0.8", "1")}
    assert given == {"67108864": 2**26, "64MiB": 2**26, "1.5GiB": 3 * 2**29, "0.8": 0.8, "1": 1}
    assert parse_args([]).kv_memory is None and parse_args([]).block_size == 16
    assert kv_memory(shipped, torch.float32, None, "cuda", 2, 2) == 0.9  # of each device's free memory
    assert kv_memory(shipped, torch.float32, 0.5, "cuda", 2, 2) == 0.5
    assert kv_memory(shipped, torch.float32, None, "cpu", 2, 2) is None  # every slot's whole context
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 102400 kB\n")  # 100 MiB, shared by the host's ranks
    monkeypatch.setattr(pool, "_MEMINFO", meminfo)
    weights = shipped.shard_bytes(0, 2, torch.float32) + shipped.shard_bytes(1, 2, torch.float32)
    assert kv_memory(shipped, torch.float32, 0.5, "cpu", 2, 2) == int(0.5 * (100 * 2**20 - weights) / 2)


def test_protocol_flag() -> None:
    assert parse_args(["--protocol", "v2"]).protocol == "v2"
    with pytest.raises(SystemExit):
        parse_args(["--protocol", "v3"])


def test_demo_refuses_slots_whose_caches_would_not_fit_before_any_rank_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--slots", "4294967295"]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    expected = "error: --slots 4294967295, --max-seq-len 256: the weights and KV caches of 2 rank(s) would take "
    assert out == "" and line.startswith(expected), line
    assert "GiB of memory (a --kv-memory, fewer --slots or a shorter --max-seq-len needs less)" in line
    assert main(["--kv-memory", "1048576GiB"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --kv-memory of 1125899906842624 bytes a rank: the weights and KV caches of 2 "), line
    assert line.endswith("GiB of memory (a smaller --kv-memory needs less)"), line


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A copy of the shipped model, to spoil."""
    from metrale_model_engine.reference import SHIPPED_MODEL

    return Path(shutil.copytree(SHIPPED_MODEL, tmp_path / "model"))


def _ours() -> set[str]:
    """Our segments in ``/dev/shm``."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {name for name in os.listdir("/dev/shm") if name.startswith("metrale-")}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--world-size", "5"), "--world-size 5 cannot split the model: each rank holds one of its 4 attention "
         "heads at least (world sizes that can: 1 ..= 4)"),
        (("--prompt-ids", "1,2,256"), "prompt 1: prompt[2]=256 is outside the vocabulary (0 ..= 255)"),
        (("--prompt", "a", "--prompt-ids", ""), "prompt 2 is empty: a prompt needs at least one token"),
        (("--prompt", ""), "prompt 1 is empty: a prompt needs at least one token"),
        (("--prompt-ids", ",".join(["7"] * 300)), "prompt 1: the prompt has 300 tokens, more than max_seq_len=256"),
        (("--max-seq-len", "512"), "'max_position_embeddings' must cover the context asked for (512), got 256"),
        (("--model", "/nonexistent/model"), "/nonexistent/model: no such directory"),
    ],
)  # fmt: skip
@pytest.mark.serial  # reads every segment in /dev/shm
def test_demo_refuses_what_the_model_cannot_serve_before_any_rank_starts(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _ours()
    assert main(list(args)) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert out == "" and line.startswith("error: ") and message in line, line
    assert _ours() == before  # nothing was made, nothing is left


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda model: (model / "tokenizer.json").unlink(), "prompt 1 is text, but {model} has no tokenizer.json: "
         "give it as --prompt-ids"),
        (lambda model: (model / "model.safetensors").unlink(), "{model}: no *.safetensors file"),
        (lambda model: (model / "tokenizer.json").write_text("{}"), "{model}/tokenizer.json: not a tokenizer"),
        (lambda model: (model / "config.json").write_text("{"), "{model}/config.json: not valid JSON"),
        (lambda model: (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:-8]),
         "{model}/model.safetensors: truncated: tensor data does not end where its header says"),
    ],
)  # fmt: skip
def test_demo_refuses_a_spoilt_checkpoint_in_one_line_naming_it(
    spoil: object, message: str, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert callable(spoil)
    spoil(model_dir)
    assert main(["--model", str(model_dir), "--prompt", "Licensed"]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert out == "" and line.startswith(f"error: {message.format(model=model_dir)}"), line


def recovery(ranks_before: int, lost: tuple[int, ...]) -> Recovery:
    """A recovery from ``ranks_before`` ranks that lost ``lost`` (their ranks before it); times of no matter."""
    left = tuple(rank for rank in range(ranks_before) if rank not in lost)
    gone = tuple(LostRank(rank, "was killed by SIGKILL") for rank in lost)
    return Recovery(1, ranks_before, len(left), gone, 0.0, 0.0, 0.0, (), (), 0.0, ranks=left)


def test_the_ranks_recovered_from_are_numbered_as_at_the_start_across_recoveries() -> None:
    """Rank 1 of 4 lost, then rank 2 of the 3 left (rank 3 at the start), then rank 1 of the 2 left (rank 2)."""
    assert recovered_ranks([]) == []
    assert recovered_ranks([recovery(4, (1,))]) == [1]
    assert recovered_ranks([recovery(4, (1,)), recovery(3, (2,)), recovery(2, (1,))]) == [1, 2, 3]
    assert recovered_ranks([recovery(4, (3, 2)), recovery(2, (1,))]) == [1, 2, 3]


def test_the_launcher_counts_a_loss_the_head_recovered_from_as_no_failure(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0 and a line naming the ranks recovered from; any other rank's failure, or the head's, exits 1."""
    assert verdict([0, 0, 0, 0], []) == 0 and capsys.readouterr() == ("", "")
    assert verdict([0, 0, 0, -9], [3]) == 0
    assert capsys.readouterr() == (
        "worker rank(s) [3] lost and recovered from: the run went on over the ranks left "
        "(worker rank exit codes [0, 0, -9])\n",
        "",
    )
    assert verdict([0, 0, 0, -9], []) == 1
    assert capsys.readouterr() == ("", "error: worker rank exit codes [0, 0, -9]\n")
    assert verdict([0, 1, 0, -9], [3]) == 1
    assert capsys.readouterr() == (
        "",
        "error: worker rank exit codes [1, 0, -9]; worker rank(s) [3] lost and recovered from\n",
    )
    assert verdict([1, 0, -9], [2]) == 1 and capsys.readouterr() == ("", "")  # the head said why, itself


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_a_run_that_cannot_start_is_said_by_rank_0_while_the_others_wait_for_it(
    rank: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun's agent ends every rank once one has exited: another rank exits only once rank 0 had time to say
    why (the same check holds it up), or rank 0 is ended before its line."""
    for name, value in {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("METRALE_EP_PROTOCOL", "garbage")
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)  # the launcher's wait
    assert main([]) == 2
    said = capsys.readouterr().err.splitlines()
    if rank == "0":
        assert (said, waits) == (["error: " + PROTOCOL_REFUSED], [])
    else:
        assert (said, waits) == ([], [launch.RANK_0_SAYS_WHY_S])


PROTOCOL_REFUSED = (
    "METRALE_EP_PROTOCOL='garbage' is not a protocol version; accepted: 'v1', 'v2' (or unset/empty for 'v1')"
)
