"""Public modules: each surface pinned, classes with their source and help, dir() the surface, old names warn."""

import importlib
import inspect
import pydoc
import types
import warnings

import pytest

import metrale_model_engine

SURFACES = {
    "metrale_model_engine.demo": ["LATE_PROMPTS", "LATE_STEP", "PROMPTS", "Work", "main", "parse_args", "serve"],
    "metrale_model_engine": [
        "CMD_SHUTDOWN",
        "DEFAULT_COMMAND_TIMEOUT",
        "PROTOCOL_ENV_VAR",
        "U32_MAX",
        "ArrayInterface",
        "EpCommandFailed",
        "EpCommandRefused",
        "EpDivergenceError",
        "EpError",
        "EpLink",
        "EpLinkError",
        "EpMismatchError",
        "EpReceiveError",
        "EpRoleError",
        "EpSendError",
        "EpSetupError",
        "EpTransport",
        "EpWorkerFailed",
        "LinkedEp",
        "ModelEp",
        "ProtocolVersion",
        "RunStopped",
        "SequenceState",
        "TokenArray",
        "WorkerFailure",
        "WorkerSummary",
        "as_u32_buffer",
        "check_slot",
        "check_u32",
        "run_worker",
    ],
    "metrale_model_engine.wire": [
        "ANSWER_BYTES",
        "DIGEST_EDGE",
        "FRAME_PAYLOAD",
        "FRAME_WORDS",
        "U32_MAX",
        "U32_MIN",
        "U32_TYPECODE",
        "WIRE_VERSION",
        "Ack",
        "AnswerKind",
        "Item",
        "ItemKind",
        "Report",
        "WireError",
        "decode_answer",
        "decode_header",
        "decode_item",
        "decode_tokens",
        "decode_word",
        "describe_item",
        "encode_ack",
        "encode_close",
        "encode_command",
        "encode_header",
        "encode_report",
        "encode_sync",
        "encode_tokens_prefix",
        "encode_word",
        "fold_message",
        "frame_length",
        "frame_message",
    ],
    "metrale_model_engine.transport": [
        "EpTransport",
        "HeadEnd",
        "HeadTransport",
        "NamesSilentRanks",
        "PeerLost",
        "PretendGroup",
        "Reformable",
        "Regroup",
        "SoloTransport",
        "TransportClosed",
        "TransportCorrupt",
        "TransportTimeout",
        "WorkerEnd",
        "WorkerTransport",
    ],
    "metrale_model_engine.shm": [
        "CHECK_INTERVAL",
        "DEFAULT_CHUNK_BYTES",
        "DEFAULT_MAX_SPIN_TIME",
        "DEFAULT_RING_BYTES",
        "DEFAULT_SETUP_TIMEOUT",
        "DEFAULT_SPIN_TIME",
        "MAX_WORLD_SIZE",
        "ShmTransport",
        "run_ring",
        "shm_supported",
    ],
    "metrale_model_engine.batching": ["check_batch", "prefill_chunks", "recv_batch", "send_batch"],
    "metrale_model_engine.reform": ["DEFAULT_REFORM_TIMEOUT", "LostRank", "Reform", "reform_link"],
    "metrale_model_engine.testing": ["EpEvent", "EventKind", "RecordingEp", "RecordingTransport", "ReplayTransport"],
    "metrale_model_engine.toy": ["VOCAB_SIZE", "ToyCommand", "ToyModel", "ToySlots", "ToyState", "slots_digest"],
}
TORCH_SURFACE = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_HEAD_LOST_AFTER",
    "DEFAULT_HEARTBEAT",
    "DEFAULT_IDLE_TIMEOUT",
    "EXIT_GRACE",
    "HEAD_LOST_EXIT_CODE",
    "TRANSPORT_KINDS",
    "Collectives",
    "HostsTransport",
    "TorchTransport",
    "TransportKind",
    "cuda_available",
    "default_backend",
    "free_port",
    "init_group_from_env",
    "init_local_group",
    "open_link",
    "open_transport",
    "run_group",
    "tensor_tokens",
]


REFERENCE_SURFACE = [
    "AllReduce",
    "CMD_ALLOC",
    "CMD_DECODE",
    "CMD_PREFILL",
    "Checkpoint",
    "CheckpointError",
    "Completion",
    "DecodeGraphs",
    "DecodeStep",
    "ExpertRouting",
    "FinishReason",
    "KvBlocks",
    "GREEDY",
    "LmConfig",
    "LmSlots",
    "LmState",
    "OpCount",
    "Recovery",
    "ReferenceLm",
    "Request",
    "SHIPPED_MODEL",
    "Sampler",
    "Sampling",
    "ServedLm",
    "Server",
    "Shard",
    "ShardedLm",
    "TimeSpent",
    "TokenLogprobs",
    "Tokenizer",
    "WAITING_OPS",
    "check_decode",
    "check_prefill",
    "check_prompt",
    "check_world",
    "count_ops",
    "decode_span",
    "kv_digest",
    "run_summary",
    "summary_lines",
    "token_logprobs",
]


CHECKPOINT_SURFACE = [
    "DTYPES",
    "FAMILIES",
    "MIXTRAL",
    "QWEN3_MOE",
    "SHIPPED_MODEL",
    "Checkpoint",
    "CheckpointError",
    "Family",
    "Piece",
    "Reshard",
    "TensorEntry",
    "Tokenizer",
    "byte_tokenizer",
    "export_state",
    "load_shard",
    "load_state",
    "pieces",
    "reshard",
    "save_checkpoint",
]


def surfaces() -> dict[str, list[str]]:
    found = dict(SURFACES)
    if importlib.util.find_spec("torch") is not None:
        found["metrale_model_engine.torch"] = TORCH_SURFACE
        found["metrale_model_engine.reference"] = REFERENCE_SURFACE
        found["metrale_model_engine.reference.checkpoint"] = CHECKPOINT_SURFACE
    return found


@pytest.mark.parametrize(("name", "surface"), sorted(surfaces().items()))
def test_each_public_module_exports_exactly_its_surface(name: str, surface: list[str]) -> None:
    module = importlib.import_module(name)
    assert sorted(module.__all__) == sorted(surface)
    for public in surface:
        getattr(module, public)


@pytest.mark.parametrize(("name", "surface"), sorted(surfaces().items()))
def test_every_public_class_and_function_shows_its_source_and_its_help(name: str, surface: list[str]) -> None:
    """Classes and functions keep the module that defines them as ``__module__``: ``inspect.getsource`` and
    ``help()`` find them.  Every public module has at least one (``batching`` has functions only)."""
    module = importlib.import_module(name)
    checked = []
    for public in surface:
        value = getattr(module, public)
        if isinstance(value, type) and not isinstance(value, types.GenericAlias):  # 3.10: list[X] is a type
            keyword = "class"
        elif inspect.isfunction(value):
            keyword = "def"
        else:
            continue
        assert value.__module__.startswith("metrale_model_engine"), (public, value.__module__)
        assert f"{keyword} {value.__name__}" in inspect.getsource(value), public
        doc = inspect.getdoc(value)
        assert doc and doc.splitlines()[0] in pydoc.render_doc(value), public
        checked.append(public)
    assert checked, f"{name} exports no class or function: this test checked nothing"


@pytest.mark.parametrize(("name", "surface"), sorted(surfaces().items()))
def test_dir_of_a_public_module_shows_its_surface_and_nothing_else(name: str, surface: list[str]) -> None:
    module = importlib.import_module(name)
    shown = [entry for entry in dir(module) if not entry.startswith("_") and entry not in surface]
    submodules = [entry for entry in shown if isinstance(getattr(module, entry), types.ModuleType)]
    assert shown == submodules, shown  # annotations, TYPE_CHECKING, the modules it imports: not listed
    assert all(getattr(module, entry).__name__ == f"{name}.{entry}" for entry in submodules)


def test_the_root_holds_what_a_user_writes() -> None:
    assert len(metrale_model_engine.__all__) <= 30  # about 25: the trait, the link, the errors, the helpers


@pytest.mark.parametrize(
    ("old", "home", "new"),
    [
        ("EpProtocol", "metrale_model_engine", "ProtocolVersion"),
        ("FRAME_WORDS", "metrale_model_engine.wire", "FRAME_WORDS"),
        ("WIRE_VERSION", "metrale_model_engine.wire", "WIRE_VERSION"),
        ("FrameKind", "metrale_model_engine.wire", "ItemKind"),
        ("U32_MIN", "metrale_model_engine.wire", "U32_MIN"),
        ("U32_TYPECODE", "metrale_model_engine.wire", "U32_TYPECODE"),
    ],
)
def test_a_renamed_name_still_works_for_one_release_and_warns(old: str, home: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"metrale_model_engine\.{old} is now {home}\.{new}; .* goes in 0\.3"):
        value = getattr(metrale_model_engine, old)
    assert value is getattr(importlib.import_module(home), new)


@pytest.mark.parametrize("old", ["WireEp", "Broadcast", "INLINE_TOKENS"])
def test_a_replaced_name_says_what_replaced_it(old: str) -> None:
    with pytest.raises(AttributeError, match=rf"metrale_model_engine\.{old} was replaced: "):
        getattr(metrale_model_engine, old)
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        metrale_model_engine.Nothing  # type: ignore[attr-defined]  # noqa: B018


def test_the_renamed_launchers_warn_and_still_run() -> None:
    from metrale_model_engine import shm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="world_size must be an int in 1"):
            shm.run_local(print, 0)  # deprecated: the checks still run
    assert any("run_local is now run_ring" in str(w.message) for w in caught)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the reference package needs torch")
def test_the_renamed_server_module_warns_and_gives_the_schedulers_names() -> None:
    import sys

    sys.modules.pop("metrale_model_engine.reference.server", None)
    with pytest.warns(DeprecationWarning, match=r"reference\.server is now metrale_model_engine\.reference\.scheduler"):
        old = importlib.import_module("metrale_model_engine.reference.server")
    new = importlib.import_module("metrale_model_engine.reference.scheduler")
    assert all(getattr(old, name) is getattr(new, name) for name in old.__all__)


REFERENCE = "metrale_model_engine.reference"
SERVING = f"{REFERENCE}.serving"
MOVED = [
    *(("metrale_model_engine.torch", name, REFERENCE) for name in ("count_ops", "OpCount", "WAITING_OPS")),
    *((old, "RunStopped", "metrale_model_engine") for old in (REFERENCE, SERVING)),
    *((old, "EXIT_GRACE", "metrale_model_engine.torch") for old in (REFERENCE, SERVING)),
    *((SERVING, name, REFERENCE) for name in ("CMD_PREFILL", "check_decode")),
]
"""``(old module, name, new home)``: the op count moved to the reference package, beside the model it measures;
the protocol's names left the reference package, whose ``serving`` module gave them and its own before its parts
moved to ``rank``."""


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="the reference package and the op count need torch"
)
@pytest.mark.parametrize(("old", "name", "home"), MOVED)
def test_a_moved_name_has_one_home_and_its_old_name_warns(old: str, name: str, home: str) -> None:
    module = importlib.import_module(old)
    assert name not in getattr(module, "__all__", ()) and name not in dir(module)
    with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} is now {home}\.{name}; the old name goes in 0\.3$"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError, match=rf"module '{old}' has no attribute 'Nothing'"):
        module.Nothing  # noqa: B018
