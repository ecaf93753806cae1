import subprocess
import sys

import metrale_model_engine


def test_every_public_name_is_exported() -> None:
    for name in metrale_model_engine.__all__:
        assert getattr(metrale_model_engine, name) is not None
    for name in (
        "ModelEp",
        "EpCommandFailed",
        "SequenceState",
        "ProtocolVersion",
        "run_worker",
        "EpLink",
        "LinkedEp",
    ):
        assert name in metrale_model_engine.__all__


def test_importing_the_core_never_imports_torch() -> None:
    code = (
        "import sys, metrale_model_engine, metrale_model_engine.testing, metrale_model_engine.toy; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "False"
