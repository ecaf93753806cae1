"""Checkpoints in the Hugging Face layout: what is read from them, what is refused (one line naming the file and
the field or tensor), and ``transformers`` as the independent oracle at one rank.

The same checkpoints at 2 and 4 ranks, over shared memory and over torch, are in
``tests/ranks/test_checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")
pytest.importorskip("transformers", reason="the test-torch extra is not installed")

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from metrale_model_engine import EpLink
from metrale_model_engine.demo import PROMPTS
from metrale_model_engine.reference import (
    SHIPPED_MODEL,
    Checkpoint,
    CheckpointError,
    LmConfig,
    ReferenceLm,
    Request,
    Server,
    ShardedLm,
    Tokenizer,
)
from metrale_model_engine.reference.checkpoint import (
    QWEN3_MOE,
    Piece,
    byte_tokenizer,
    files,
    load_shard,
    loader,
    pieces,
    reshard,
    save_checkpoint,
)
from metrale_model_engine.transport import SoloTransport

from helpers import checkpoint_sessions as sessions
from helpers import oracle
from helpers.greedy import byte_ids

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One random checkpoint of each family, written by transformers (read-only: copy it to spoil it)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: oracle.write_checkpoint(root / family, family) for family in oracle.FAMILIES}


def served(directory: Path | None, prompts: Any, new_tokens: int, **kwargs: Any) -> list[list[int]]:
    """The tokens one rank serves for ``prompts`` (greedy, every one of ``new_tokens``: no end-of-sequence stop)."""
    model = ReferenceLm(EpLink(SoloTransport(), num_slots=3), checkpoint=directory, **kwargs)
    server = Server(model, prefill_chunk=5, eos_token_ids=())
    done = server.run(Request(i, tuple(prompt), new_tokens) for i, prompt in enumerate(prompts))
    return [done[i].tokens for i in range(len(prompts))]


# transformers, the oracle


def test_transformers_continues_the_shipped_model_with_the_demos_text() -> None:
    prompts = [byte_ids(text) for text in PROMPTS]
    expected, tops = oracle.reference_tokens(SHIPPED_MODEL, prompts, 48)
    gap = oracle.smallest_gap(tops)
    assert served(None, prompts, 48) == expected
    assert gap > 1e-2  # far from a tie: rounding cannot flip a token
    assert bytes(expected[0]).decode().startswith(' Apache License, Version 2.0 (the "License")')


@pytest.mark.parametrize("family", oracle.FAMILIES)
def test_one_rank_gives_the_tokens_of_transformers(written: dict[str, Path], family: str) -> None:
    expected, tops = oracle.reference_tokens(written[family])
    gap = oracle.smallest_gap(tops)
    assert gap > 1e-4, gap  # rounding is about 1e-6 here: a flip would need a near tie
    assert served(written[family], oracle.PROMPTS, oracle.NEW_TOKENS) == expected
    kv_memory = sessions.tight_kv_memory(written[family], 0, 1)
    for prefix_caching in (True, False):  # the prompts twice: with prefix hits, and without
        model = ReferenceLm(EpLink(SoloTransport(), num_slots=sessions.SLOTS), checkpoint=written[family],
                            kv_memory=kv_memory, block_size=sessions.BLOCK_SIZE)  # fmt: skip
        tokens, preemptions, hits = sessions.served_tokens(model, prefix_caching=prefix_caching)
        assert tokens == expected * 2 and preemptions > 0  # across preemptions, the same tokens
        assert hits > 0 if prefix_caching else hits == 0


def test_generation_stops_at_the_end_of_sequence_ids_as_transformers_does(
    written: dict[str, Path], tmp_path: Path
) -> None:
    directory = _copy(written["mixtral"], tmp_path)
    free, _ = oracle.reference_tokens(directory)
    eos = [free[0][4], free[1][2]]  # two ids that greedy decoding generates mid-way
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    expected, _ = oracle.reference_tokens(directory, stop_at_eos=True)
    model = ReferenceLm(EpLink(SoloTransport(), num_slots=3), checkpoint=directory)
    assert model.eos_token_ids == frozenset(eos)
    done = Server(model, prefill_chunk=5).run(Request(i, p, oracle.NEW_TOKENS) for i, p in enumerate(oracle.PROMPTS))
    assert [done[i].tokens for i in range(len(oracle.PROMPTS))] == expected
    reasons = [done[i].finish_reason for i in range(len(oracle.PROMPTS))]
    assert reasons == ["stop" if tokens[-1] in eos else "length" for tokens in expected] and reasons.count("stop") >= 2
    (directory / "generation_config.json").unlink()  # then config.json's id, as transformers has it
    assert Checkpoint.open(directory).eos_token_ids == (
        json.loads((directory / "config.json").read_text())["eos_token_id"],
    )


def test_what_is_read_from_each_family(written: dict[str, Path]) -> None:
    mixtral, qwen = (Checkpoint.open(written[family]) for family in oracle.FAMILIES)
    assert mixtral.config == LmConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_experts=4, top_k=2, d_expert=96, max_seq_len=128,
        rope_base=10000.0, norm_eps=1e-5, n_kv_heads=2, head_dim=8, qk_norm=False, norm_topk_prob=True,
    )  # fmt: skip
    assert qwen.config == LmConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_experts=8, top_k=2, d_expert=32, max_seq_len=128,
        rope_base=10000.0, norm_eps=1e-6, n_kv_heads=2, head_dim=32, qk_norm=True, norm_topk_prob=False,
    )  # fmt: skip
    assert qwen.family is QWEN3_MOE and mixtral.family.architecture == "MixtralForCausalLM"
    assert mixtral.dtype == torch.float32 and mixtral.tokenizer_file is None
    assert Checkpoint.open(written["mixtral"], max_seq_len=64).config.max_seq_len == 64
    assert mixtral.weight_bytes() == sum(4 * math.prod(entry.shape) for entry in mixtral.tensors.values())
    whole = mixtral.shard_bytes(0, 1, torch.float32)
    assert whole == mixtral.weight_bytes()
    halves = [mixtral.shard_bytes(rank, 2, torch.float32) for rank in range(2)]
    assert halves[0] == halves[1] < whole < sum(halves)  # the replicated parts are on both
    assert mixtral.shard_bytes(0, 2, torch.bfloat16) * 2 == halves[0]
    thirds = [ShardedLm(mixtral.config, num_blocks=1, rank=rank, world_size=3, all_reduce=print) for rank in range(3)]
    assert thirds[1].shard.pad_before == 1  # its zero head is part of its weights
    assert [mixtral.shard_bytes(rank, 3, torch.float32) for rank in range(3)] == [
        4 * sum(parameter.numel() for parameter in third.parameters()) for third in thirds
    ]


def test_the_shipped_tokenizer_is_utf8_bytes() -> None:
    tokenizer = Tokenizer.from_file(SHIPPED_MODEL / "tokenizer.json")
    assert tokenizer.vocab_size == 256
    assert tokenizer.encode("Aé€") == [65, 0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    assert tokenizer.decode(tokenizer.encode("Licensed under the «License»")) == "Licensed under the «License»"
    assert tokenizer.decode([72, 0xFF, 105, 0xE2, 0x82]) == "H\ufffdi\ufffd"
    assert (SHIPPED_MODEL / "tokenizer.json").read_text() == byte_tokenizer().to_str(pretty=True)


def test_a_bfloat16_checkpoint_runs_in_its_dtype_or_in_float32(tmp_path: Path) -> None:
    directory = oracle.write_checkpoint(tmp_path / "bf16", "mixtral", dtype=torch.bfloat16, max_shard_size="40KB")
    opened = Checkpoint.open(directory)
    assert opened.dtype == torch.bfloat16 and len({entry.file for entry in opened.tensors.values()}) > 2
    assert (directory / "model.safetensors.index.json").exists()
    expected, _ = oracle.reference_tokens(directory, dtype=torch.float32)  # the same weights, widened
    assert served(directory, oracle.PROMPTS, oracle.NEW_TOKENS, dtype=torch.float32) == expected
    model = ReferenceLm(EpLink(SoloTransport(), num_slots=1), checkpoint=directory)
    assert all(parameter.dtype == torch.bfloat16 for parameter in model.parameters())
    theirs, tops = oracle.reference_tokens(directory, dtype=torch.bfloat16)
    for ours, their, steps in zip(served(directory, oracle.PROMPTS, oracle.NEW_TOKENS), theirs, tops, strict=True):
        parted = next((at for at, (a, b) in enumerate(zip(ours, their, strict=True)) if a != b), None)
        if parted is not None:  # only where bfloat16's 8 significant bits leave the two largest logits (nearly) tied
            first, second = steps[parted]
            step = torch.finfo(torch.bfloat16).eps * 2 ** math.floor(math.log2(abs(first)))  # bfloat16's unit there
            assert first - second <= 2 * step, (ours, their, parted, first, second)


# Refusals: one line, naming the file and what is wrong


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "model"))


def _config(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def spoil(directory: Path) -> None:
        path = directory / "config.json"
        fields = json.loads(path.read_text())
        edit(fields)
        path.write_text(json.dumps(fields))

    return spoil


def _set(**values: Any) -> Callable[[Path], None]:
    return _config(lambda fields: fields.update(values))


def _drop(name: str) -> Callable[[Path], None]:
    return _config(lambda fields: fields.pop(name))


def _tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def spoil(directory: Path) -> None:
        path = directory / "model.safetensors"
        state = load_file(path)
        edit(state)
        save_file(state, path)

    return spoil


def _bytes(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def spoil(directory: Path) -> None:
        path = directory / "model.safetensors"
        path.write_bytes(edit(path.read_bytes()))

    return spoil


ROUTER = "model.layers.1.block_sparse_moe.gate.weight"


@pytest.mark.parametrize(
    ("family", "spoil", "message"),
    [
        ("mixtral", _set(architectures=["LlamaForCausalLM"]), "config.json: architectures=['LlamaForCausalLM'] is "
         "not supported: the architectures served are MixtralForCausalLM, Qwen3MoeForCausalLM"),
        ("mixtral", _set(model_type="llama"), "config.json: 'model_type' must be 'mixtral' for MixtralForCausalLM"),
        ("mixtral", _set(sliding_window=64), "config.json: sliding_window=64 is not supported: sliding-window "
         "attention is not implemented; serve at most 64 positions"),
        ("mixtral", _set(rope_scaling={"rope_type": "linear", "factor": 2.0}), "config.json: rope_scaling="),
        ("mixtral", _set(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "config.json: rope_parameters="),
        ("mixtral", _set(hidden_act="gelu"), "config.json: hidden_act='gelu' is not supported"),
        ("mixtral", _set(quantization_config={"bits": 4}), "config.json: field 'quantization_config' is not supported"),
        ("mixtral", _set(num_attention_heads="8"), "config.json: 'num_attention_heads' must be an int, got '8'"),
        ("mixtral", _set(rms_norm_eps=0), "config.json: 'rms_norm_eps' must be positive and finite, got 0"),
        ("mixtral", _set(tie_word_embeddings="no"), "config.json: 'tie_word_embeddings' must be true or false"),
        ("mixtral", _drop("vocab_size"), "config.json: the field 'vocab_size' is missing"),
        ("mixtral", _set(num_attention_heads=3), "config.json: its fields make no model: num_attention_heads=3 must "
         "divide hidden_size=64"),
        ("mixtral", _set(num_experts_per_tok=5), "config.json: its fields make no model: num_experts_per_tok=5 must "
         "not exceed the expert count=4"),
        ("mixtral", _set(eos_token_id=999), "config.json: eos_token_id 999 must be ids of the vocabulary (0 ..= 127)"),
        ("mixtral", _set(dtype="int8"), "config.json: 'dtype' must be one of float32, bfloat16, float16, got 'int8'"),
        ("mixtral", _set(layer_types=["full_attention", "sliding_attention"]), "config.json: layer_types="),
        ("qwen3_moe", _set(mlp_only_layers=[1]), "config.json: mlp_only_layers=[1] is not supported: every layer"),
        ("qwen3_moe", _set(decoder_sparse_step=2), "config.json: decoder_sparse_step=2 is not supported"),
        ("qwen3_moe", _set(attention_bias=True), "config.json: attention_bias=True is not supported"),
        ("qwen3_moe", _set(use_sliding_window=True, sliding_window=32), "config.json: sliding_window=32 is not"),
        ("mixtral", lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [2, -1]}'),
         "generation_config.json: eos_token_id [2, -1] must be ids of the vocabulary"),
        ("mixtral", lambda d: (d / "config.json").unlink(), "config.json: no such file"),
        ("mixtral", lambda d: (d / "config.json").write_text("[1]"), "config.json: a JSON list, not an object"),
        ("mixtral", lambda d: (d / "config.json").write_text("{"), "config.json: not valid JSON"),
        ("mixtral", lambda d: (d / "model.safetensors").unlink(), ": no *.safetensors file (and no model.safetensors"),
        ("mixtral", _tensors(lambda state: state.__delitem__(ROUTER)), f": no tensor '{ROUTER}' in any of its files"),
        ("mixtral", _tensors(lambda state: state.update({ROUTER: torch.zeros(4, 63)})), f"model.safetensors: tensor "
         f"'{ROUTER}' has shape [4, 63], the config needs [4, 64]"),
        ("mixtral", _tensors(lambda state: state.update({"extra.bias": torch.zeros(2)})), "model.safetensors: tensor "
         "'extra.bias' is not part of a MixtralForCausalLM of this config"),
        ("mixtral", _tensors(lambda state: state.update({ROUTER: torch.zeros(4, 64, dtype=torch.int32)})), f"tensor "
         f"'{ROUTER}' is I32, not one of F32, BF16, F16"),
        ("mixtral", _bytes(lambda raw: raw[:-100]), "model.safetensors: truncated: tensor "),
        ("mixtral", _bytes(lambda raw: raw[:5]), "model.safetensors: truncated: 5 bytes, less than the 8-byte header"),
        ("mixtral", _bytes(lambda raw: struct.pack("<Q", 2**40) + raw[8:]), "model.safetensors: corrupt or truncated: "
         "its header length is 1099511627776 bytes"),
        ("mixtral", _bytes(lambda raw: raw[:8] + b"\xff" + raw[9:]), "model.safetensors: corrupt header: not valid"),
        ("mixtral", _bytes(lambda raw: struct.pack("<Q", len(raw)) + raw[8:]), "model.safetensors: corrupt or "
         "truncated: its header length is "),  # past the file's end, under safetensors' own limit
        ("mixtral", _bytes(lambda raw: raw.replace(b'"data_offsets":[0,', b'"data_offsets":[9,', 1)),
         "model.safetensors: corrupt: invalid offset for tensor `"),
        ("mixtral", lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir()),
         "model.safetensors: cannot be read ("),
    ],
)  # fmt: skip
def test_a_bad_checkpoint_is_refused_in_one_line_naming_it(
    written: dict[str, Path], tmp_path: Path, family: str, spoil: Callable[[Path], None], message: str
) -> None:
    directory = _copy(written[family], tmp_path)
    spoil(directory)
    with pytest.raises(CheckpointError) as refused:
        Checkpoint.open(directory)
    text = str(refused.value)
    assert text.startswith(str(directory)) and message in text and "\n" not in text, text


def test_a_file_gone_before_its_refusal_is_named_as_unreadable(tmp_path: Path) -> None:
    """safe_open refused the file, which then could not be read to say how: the refusal names it as unreadable."""
    gone = tmp_path / "model.safetensors"
    assert files._refusal(gone, "header too small") == f"{gone}: cannot be read (No such file or directory)"


def test_what_does_not_change_the_arithmetic_is_served(written: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(written["mixtral"], tmp_path)
    _set(sliding_window=4096, attention_dropout=0.1, rope_theta=10000.0, rope_scaling=None)(directory)
    assert Checkpoint.open(directory).config == Checkpoint.open(written["mixtral"]).config
    _set(torch_dtype="bfloat16", dtype=None)(directory)  # transformers 4's name for the dtype
    assert Checkpoint.open(directory).dtype == torch.bfloat16
    _set(num_experts=4)(directory)  # the count under its other name too: they agree
    assert Checkpoint.open(directory).config.n_experts == 4
    _set(num_experts=8)(directory)
    with pytest.raises(CheckpointError, match=r"'num_local_experts' must equal num_experts=8 \(both count the experts"):
        Checkpoint.open(directory)


def test_an_index_is_followed_and_checked(tmp_path: Path) -> None:
    directory = oracle.write_checkpoint(tmp_path / "sharded", "mixtral", max_shard_size="40KB")
    index = directory / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 2 and Checkpoint.open(directory).tensors[ROUTER].file.name == weight_map[ROUTER]
    (directory / files[-1]).unlink()
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json: tensor '.*' is in {files[-1]}, which"):
        Checkpoint.open(directory)
    index.write_text(json.dumps({"weight_map": {**weight_map, ROUTER: files[0]}}))
    if weight_map[ROUTER] != files[0]:
        with pytest.raises(CheckpointError, match=rf"{files[0]}: has no tensor '{ROUTER}', which model.safetensors"):
            Checkpoint.open(directory)
    index.write_text(json.dumps({"weight_map": {ROUTER: "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"is mapped to '\.\./elsewhere\.safetensors', not a file of the dir"):
        Checkpoint.open(directory)


def test_a_missing_directory_and_a_context_past_the_model_are_refused(written: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match=r"^/nonexistent: no such directory$"):
        Checkpoint.open("/nonexistent")
    with pytest.raises(CheckpointError, match=r"config.json: not a directory|: not a directory$"):
        Checkpoint.open(written["mixtral"] / "config.json")
    with pytest.raises(CheckpointError, match=r"'max_position_embeddings' must cover the context asked for \(256\)"):
        Checkpoint.open(written["mixtral"], max_seq_len=256)


def test_a_model_is_written_only_as_mixtral_can_hold_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a Mixtral checkpoint has no per-head query/key norms"):
        save_checkpoint(tmp_path, ShardedLm(LmConfig(qk_norm=True), num_blocks=1))
    with pytest.raises(ValueError, match="only a one-rank model holds every weight; this is rank 0 of 2"):
        save_checkpoint(tmp_path, ShardedLm(LmConfig(), num_blocks=1, world_size=2, all_reduce=print))
    with pytest.raises(ValueError, match="the model's dtype must be one of float32, bfloat16, float16, got"):
        save_checkpoint(tmp_path, ShardedLm(LmConfig(), num_blocks=1, dtype=torch.float64))


# A rank's change of shard: what it holds already, what it reads


SURVIVORS: Final = {
    (4, 3): {0: 0, 2: 1, 3: 2},  # rank 1 lost: the survivors renumbered in rank order
    (3, 2): {0: 0, 1: 1},  # rank 2 lost
    (2, 1): {1: 0},  # rank 0 lost
}
"""Per change of world size, each survivor's old rank and its new one."""


def _requests(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every slice ``load_shard`` asks the files for from now on, as ``(tensor name, index)``."""
    requested: list[tuple[str, Any]] = []

    class Slice:
        def __init__(self, name: str, whole: Any) -> None:
            self.name, self.whole = name, whole

        def __getitem__(self, index: Any) -> Any:
            requested.append((self.name, index))
            return self.whole[index]

    class Handle:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def get_slice(self, name: str) -> Slice:
            return Slice(name, self.handle.get_slice(name))

    @contextlib.contextmanager
    def spied(*args: Any, **kwargs: Any) -> Iterator[Handle]:
        with safe_open(*args, **kwargs) as handle:
            yield Handle(handle)

    monkeypatch.setattr(loader, "safe_open", spied)
    return requested


def _marks(shape: tuple[int, ...], *parts: Piece) -> torch.Tensor:
    """A tensor of ``shape`` counting, for each element, the ``parts`` that read it."""
    marks = torch.zeros(shape, dtype=torch.int32)
    for part in parts:
        marks[part.part] += 1
    return marks


def test_a_shrinking_world_keeps_what_each_survivor_holds() -> None:
    """The shipped model (4 heads, 4 KV heads, 4 experts) from 4 ranks to 3, rank 3 lost: rank 0 had head 0 and
    expert 0 and now holds heads 0-1 and experts 0-1: it reads head 1's rows and columns and expert 1, nothing else."""
    shipped = Checkpoint.open()
    config, family, head = shipped.config, shipped.family, shipped.config.head_dim
    change = reshard(config, family, config.shard(0, 4), config.shard(0, 3))
    for layer in range(config.n_layers):
        attention, expert = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.block_sparse_moe.experts.1."
        assert [
            (piece.name, piece.part) for piece in change.missing if piece.name.startswith(f"model.layers.{layer}.")
        ] == [
            *((f"{attention}{proj}_proj.weight", (slice(head, 2 * head),)) for proj in "qkv"),
            (f"{attention}o_proj.weight", (slice(None), slice(head, 2 * head))),
            *((f"{expert}{w}.weight", ()) for w in ("w1", "w3", "w2")),
        ]
    assert {piece.name for piece in change.missing} | {new.name for _, new in change.held} == {
        piece.name for piece in pieces(config, family, config.shard(0, 3))
    }
    assert ("model.embed_tokens.weight", ()) in [(old.name, old.part) for old, _ in change.held]
    unchanged = reshard(config, family, config.shard(1, 2), config.shard(1, 2))
    assert unchanged.missing == [] and all(old == new for old, new in unchanged.held)


@pytest.mark.parametrize("family", oracle.FAMILIES)
@pytest.mark.parametrize(("before", "after"), list(SURVIVORS))
def test_a_survivor_reads_from_the_files_only_the_slices_it_did_not_hold(
    written: dict[str, Path], monkeypatch: pytest.MonkeyPatch, family: str, before: int, after: int
) -> None:
    """Both families (8 heads of 2 KV heads and 4 experts; 4 heads of 2 KV heads and 8 experts), shrinking
    4 -> 3 -> 2 -> 1: each survivor's held and missing slices cover its new shard once, what it reads is the
    missing ones alone (none of which it held), and its parameters are those of a fresh load."""
    checkpoint = Checkpoint.open(written[family])
    config = checkpoint.config
    for old_rank, new_rank in SURVIVORS[before, after].items():
        old = ShardedLm(config, num_blocks=1, rank=old_rank, world_size=before, all_reduce=print)
        load_shard(old, checkpoint)
        fresh = ShardedLm(config, num_blocks=1, rank=new_rank, world_size=after, all_reduce=print)
        everything = load_shard(fresh, checkpoint)
        family_of = checkpoint.family
        change = reshard(config, family_of, old.shard, fresh.shard)
        held_before = {piece.name: _marks(piece.shape, piece) > 0 for piece in pieces(config, family_of, old.shard)}
        for piece in pieces(config, family_of, fresh.shard):  # held and missing: each element once
            parts = [new for _, new in change.held if new.name == piece.name]
            parts += [missing for missing in change.missing if missing.name == piece.name]
            assert torch.equal(_marks(piece.shape, *parts), _marks(piece.shape, piece)), piece.name
        for old_place, new_place in change.held:
            assert (old_place.name, old_place.part) == (new_place.name, new_place.part)
            assert bool(held_before[old_place.name][old_place.part].all())
        requested = _requests(monkeypatch)
        model = ShardedLm(config, num_blocks=1, rank=new_rank, world_size=after, all_reduce=print)
        read = load_shard(model, checkpoint, held=old)
        assert requested == [(piece.name, piece.part) for piece in change.missing]
        for piece in change.missing:
            assert piece.name not in held_before or not bool(held_before[piece.name][piece.part].any())
        assert read == 4 * sum(int(_marks(piece.shape, piece).sum()) for piece in change.missing) < everything
        for (name, ours), theirs in zip(model.named_parameters(), fresh.parameters(), strict=True):
            assert torch.equal(ours, theirs), name
        monkeypatch.undo()


def test_a_held_model_of_another_checkpoint_is_refused(written: dict[str, Path]) -> None:
    mixtral, qwen = (Checkpoint.open(written[family]) for family in oracle.FAMILIES)
    held = ShardedLm(qwen.config, num_blocks=1)
    with pytest.raises(ValueError, match=r"the held model's config LmConfig\(.*n_heads=4.* is not the checkpoint's"):
        load_shard(ShardedLm(mixtral.config, num_blocks=1), mixtral, held=held)
