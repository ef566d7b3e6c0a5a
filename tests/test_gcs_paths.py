"""gs:// paths end to end against a Cloud Storage emulator on loopback (gcp-storage-emulator,
started here, in memory; tensorstore and gcsfs pointed at it): a run trained into a bucket,
stopped by SIGTERM, resumed and exported there equals the same run on local disk; the export
loads from the bucket; a missing bucket or object is one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from prove_jax import storage
from prove_jax.checkpoints import checkpoint
from prove_jax.training import loop, model_source
from prove_jax.training.preemption import Preempted
from tests.train_helpers import tiny_config

pytestmark = pytest.mark.slow

BUCKET = "prove-test"

# The emulator, with the one header it lacks: Cloud Storage sends an object's generation with
# its bytes (x-goog-generation), which tensorstore's conditional writes (orbax's OCDBT
# manifests) need; the emulator only puts it in the object's JSON metadata.
EMULATOR = r"""
import sys
from gcp_storage_emulator.handlers import objects
_download = objects.download

def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
    except Exception:
        pass  # a missing object: the original handler answers 404
    return _download(request, response, storage, *args, **kwargs)

objects.download = download
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def gcs():
    """The emulator's URL; the storage clients' environment points at it for this module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", EMULATOR, "start", "--host", "127.0.0.1", "--port", str(port),
                             "--default-bucket", BUCKET, "-M"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as mp:
        # no credentials: tensorstore takes a fixed token, google-auth skips the metadata server
        for var, value in (("STORAGE_EMULATOR_HOST", url), ("TENSORSTORE_GCS_HTTP_URL", url),
                           ("GOOGLE_AUTH_TOKEN_FOR_TESTING", "test"), ("NO_GCE_CHECK", "True")):
            mp.setenv(var, value)
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert time.time() < deadline and proc.poll() is None, "the emulator did not start"
                time.sleep(0.1)
        try:
            yield f"gs://{BUCKET}"
        finally:
            proc.terminate()
            proc.wait(10)
            import gcsfs
            gcsfs.GCSFileSystem.clear_instance_cache()  # its clients point at this emulator


def _losses(records):
    return [(r["step"], r["loss"]) for r in records]


def test_a_run_trains_resumes_and_exports_into_a_bucket_like_on_disk(gcs, tmp_path, monkeypatch):
    fields = dict(steps=6, save_every=2, max_length=16, global_batch_size=4)
    local = loop.train(tiny_config(tmp_path, "local", **fields), show_bar=False)
    cfg = tiny_config(tmp_path, "remote", run_dir=f"{gcs}/runs/r", **fields)

    class SignalledAtStep3(loop.MetricsLogger):
        def record(self, step, metrics):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().record(step, metrics)
    monkeypatch.setattr(loop, "MetricsLogger", SignalledAtStep3)
    with pytest.raises(Preempted) as stopped:
        loop.train(cfg, show_bar=False)
    monkeypatch.undo()
    assert stopped.value.step == 4
    assert not os.path.exists("gs:")  # nothing written to a local ./gs:/ folder
    again = loop.train(cfg, show_bar=False)
    assert again.start_step == 4 and again.final_step == 6 and again.model_dir == f"{gcs}/runs/r/model"

    run = f"{gcs}/runs/r"
    names = set(storage.listdir(run))
    assert {"checkpoints", "model", "tokenizer", "train_config.json", "metrics.jsonl", "tensorboard"} <= names
    remote = [json.loads(x) for x in storage.read_text(f"{run}/metrics.jsonl").splitlines()]
    want = _losses(local.records)
    assert [s for s, _ in _losses(remote)] == list(range(1, 7))
    np.testing.assert_allclose([x for _, x in _losses(remote)], [x for _, x in want], rtol=1e-6)

    with storage.local_copy(f"{run}/tensorboard") as events:  # both launches' event files
        acc = EventAccumulator(events, size_guidance={"scalars": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 7))

    model = checkpoint.load_model(f"{run}/model")
    ours = checkpoint.params_pure_dict(model)
    ref = jax.tree.map(np.asarray, local.state["params"])
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), ours, ref))
    assert max(diffs) <= 1e-6
    assert checkpoint.load_tokenizer(f"{run}/model") is not None


def test_convert_writes_a_checkpoint_into_a_bucket_that_loads_like_a_local_one(gcs, tmp_path, capsys):
    from prove_jax.cli import convert
    from tests.hf_models import make_hf_qwen2
    hf = tmp_path / "hf"
    make_hf_qwen2(hf)
    remote = f"{gcs}/converted/tiny"
    assert convert.main(["hf-to-flax", "--hf-dir", str(hf), "--out", str(tmp_path / "local"), "--quiet"]) == 0
    assert convert.main(["hf-to-flax", "--hf-dir", str(hf), "--out", remote, "--quiet"]) == 0
    assert convert.main(["hf-to-flax", "--hf-dir", str(hf), "--out", remote, "--quiet"]) == 2  # not empty
    assert "already exists and is not empty" in capsys.readouterr().err
    ref = checkpoint.params_pure_dict(checkpoint.load_model(str(tmp_path / "local")))

    def same(path):
        ours = checkpoint.params_pure_dict(checkpoint.load_model(path))
        return jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                                         ours, ref))
    assert same(remote)

    assert convert.main(["flax-to-hf", "--ckpt", remote, "--out", f"{gcs}/exported/hf", "--quiet"]) == 0
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(storage.listdir(f"{gcs}/exported/hf"))

    # a training run's model.hf_dir in the bucket: its config read from there, host 0 converts
    # it once into the run dir (also in the bucket), and a relaunch finds the conversion current
    from prove_jax.checkpoints.convert import conversion_stale
    from prove_jax.models.sharding import make_mesh
    hf_remote = f"{gcs}/hf/tiny"
    storage.makedirs(hf_remote)
    storage.upload_dir(str(hf), hf_remote)
    cfg = tiny_config(tmp_path, "hfrun", run_dir=f"{gcs}/runs/hf", model={"hf_dir": hf_remote},
                      tokenizer={"path": None})
    assert model_source.source_model_config(cfg) == model_source.source_model_config(
        tiny_config(tmp_path, "hflocal", model={"hf_dir": str(hf)}, tokenizer={"path": None}))
    mesh = make_mesh((1, 1, 1))
    converted = model_source.convert_hf_once(cfg, mesh)
    assert converted == f"{gcs}/runs/hf/converted"
    assert checkpoint.load_config(converted) == checkpoint.load_config(remote)  # the same writer
    assert conversion_stale(hf_remote, converted, mesh) is None
    storage.write_text(f"{hf_remote}/config.json", storage.read_text(f"{hf_remote}/config.json") + " ")
    assert conversion_stale(hf_remote, converted, mesh) == "changed since: config.json"


def test_generate_reads_model_and_requests_from_a_bucket_and_writes_its_output_there(gcs, tmp_path, capsys):
    from prove_jax import assets
    from prove_jax.cli import generate
    storage.upload_tree(assets.DEMO_PROPOSER, f"{gcs}/demo/proposer")
    requests = "".join(json.dumps({"id": i, "prompt": p}) + "\n"
                       for i, p in enumerate(["def add(a, b):", "import os\n"]))
    (tmp_path / "in.jsonl").write_text(requests)
    storage.write_text(f"{gcs}/in.jsonl", requests)
    common = ["--mode", "lossless", "--max-new-tokens", "6", "--batch-size", "2", "--no-progress"]
    remote = ["--model", f"{gcs}/demo/proposer", "--input", f"{gcs}/in.jsonl",
              "--output", f"{gcs}/out/answers.jsonl", *common]
    assert generate.main(["--model", assets.DEMO_PROPOSER, "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(tmp_path / "out.jsonl"), *common]) == 0
    assert generate.main(remote) == 0
    local = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    written = [json.loads(x) for x in storage.read_text(f"{gcs}/out/answers.jsonl").splitlines()]
    assert sorted((r["id"], r["output_ids"]) for r in written) == sorted((r["id"], r["output_ids"]) for r in local)
    assert storage.exists(f"{gcs}/out/answers.jsonl.settings.json")
    # a rerun resumes from the bucket's output and its settings: the same job skips all, another is refused
    assert generate.main(remote[:-len(common)] + ["--mode", "ar", *common[2:]]) == 2
    assert "holds records decoded with mode='lossless'" in capsys.readouterr().err
    assert generate.main(remote) == 0
    assert "resuming: 2 of 2 requests are already in" in capsys.readouterr().err
    assert storage.read_text(f"{gcs}/out/answers.jsonl").splitlines() == [json.dumps(r) for r in written]


def test_a_missing_bucket_or_object_is_one_line(gcs):
    with pytest.raises(storage.StorageError) as e:
        storage.read_text("gs://no-such-bucket/x/config.json")
    assert str(e.value) == ("bucket gs://no-such-bucket not found (or not accessible), for "
                            "gs://no-such-bucket/x/config.json")
    with pytest.raises(storage.StorageError, match=f"^not found: {gcs}/nothing.json$"):
        storage.read_text(f"{gcs}/nothing.json")
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint directory not found: gs://no-such-bucket/m"):
        checkpoint.load_model("gs://no-such-bucket/m")


def test_commands_given_a_missing_bucket_stop_with_one_line_and_create_nothing(gcs, tmp_path, capsys):
    from prove_jax.cli import convert, train
    from tests.train_helpers import write_config
    cfg = write_config(tmp_path, "cli", steps=2)
    assert train.main(["--config", cfg, "run_dir=gs://no-such-bucket/run", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: bucket gs://no-such-bucket not found (or not accessible), for gs://no-such-bucket/run"
    assert convert.main(["flax-to-hf", "--ckpt", "gs://no-such-bucket/m", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == "error: checkpoint directory not found: gs://no-such-bucket/m"
    assert not storage.exists("gs://no-such-bucket")  # no bucket made on the way
