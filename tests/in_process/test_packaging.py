"""A built wheel carries the package, its py.typed marker and both licenses."""

import email
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("metrale_model_engine-*.whl")
    return built


def test_wheel_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {n for n in names if n.startswith("metrale_model_engine/")}
    modules = ["__init__.py", "py.typed", "_trait/model_ep.py", "_engine/link.py", "_trait/worker_loop.py"]
    modules += ["_core/codec.py", "_shm/ring.py", "_torch/transport.py", "testing.py", "toy.py", "wire.py"]
    shipped = [f"reference/tiny_moe/{name}" for name in ("config.json", "generation_config.json", "model.safetensors",
                                                         "tokenizer.json")]  # fmt: skip
    modules += [f"reference/checkpoint/{name}.py" for name in ("loader", "mixtral", "qwen3_moe")]
    for module in (*modules, *shipped):
        assert f"metrale_model_engine/{module}" in package
    licenses = {Path(n).name for n in names if "/licenses/" in n}
    assert licenses == {"LICENSE-MIT", "LICENSE-APACHE"}
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_wheel_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(metadata_name))
    assert metadata["Name"] == "metrale-model-engine"
    assert metadata["License-Expression"] == "MIT OR Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.10"
    runtime = [r for r in metadata.get_all("Requires-Dist", []) if "extra ==" not in r]
    assert [r.split(">")[0].split("=")[0].strip() for r in runtime] == ["typing-extensions"]
    assert sorted(metadata.get_all("License-File", [])) == ["LICENSE-APACHE", "LICENSE-MIT"]
