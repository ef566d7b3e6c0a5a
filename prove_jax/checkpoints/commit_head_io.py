"""Save and load the commit head beside its verifier checkpoint (MODEL_DIR/commit_head)."""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from prove_jax import distributed
from prove_jax.checkpoints.checkpoint import CheckpointError
from prove_jax.checkpoints.restore_errors import restore_failure
from prove_jax.files import atomic_dir, atomic_write_text
from prove_jax.models.commit_head import HEAD_DIR, CommitHead


def save_commit_head(model_dir: str, head: CommitHead) -> str:
    """MODEL_DIR/commit_head: params (orbax) and config.json. One process: written in a temp
    dir and renamed into place. Several: every host joins orbax's save (itself atomic: a temp
    folder the primary host finalises), then host 0 writes the config, which `load_commit_head`
    looks for first, so a save cut short reads as no head."""
    path = os.path.join(model_dir, HEAD_DIR)
    params = nnx.to_pure_dict(nnx.state(head, nnx.Param))
    meta = json.dumps(
        {"hidden_size": head.hidden_size, "width": head.width, "threshold": head.threshold}
    )
    if jax.process_count() == 1:
        with atomic_dir(path) as tmp:
            with ocp.StandardCheckpointer() as ckptr:  # closing waits for the write to finish
                ckptr.save(os.path.join(tmp, "params"), params)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                f.write(meta)
        return path
    if distributed.is_main_process() and os.path.exists(os.path.join(path, "config.json")):
        os.remove(os.path.join(path, "config.json"))  # an older head's: no longer its params
    distributed.barrier("commit_head_unmarked")
    with ocp.StandardCheckpointer() as ckptr:  # closing waits for every host's part
        ckptr.save(os.path.join(os.path.abspath(path), "params"), params, force=True)
    if distributed.is_main_process():
        atomic_write_text(os.path.join(path, "config.json"), meta)
    distributed.barrier("commit_head_saved")
    return path


def load_commit_head(model_dir: str, mesh=None) -> CommitHead:
    """The commit head saved beside a verifier; with a mesh, replicated on all its devices
    (which may be other hosts': the restore must be told, or orbax refuses the topology)."""
    path = os.path.join(model_dir, HEAD_DIR)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(
            f"{model_dir} has no trained commit head ({HEAD_DIR}/); train one with "
            f"objective=commit_head"
        )
    try:
        with open(os.path.join(path, "config.json")) as f:
            meta = json.load(f)
        head = CommitHead(int(meta["hidden_size"]), int(meta["width"]), float(meta["threshold"]),
                          rngs=nnx.Rngs(0))
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        what = (
            f"missing key {e.args[0]!r}"
            if isinstance(e, KeyError)
            else str(e).splitlines()[0][:200]
        )
        raise CheckpointError(f"bad commit head config {path}/config.json: {what}") from None
    state = nnx.state(head, nnx.Param)
    where = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
             else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                          nnx.to_pure_dict(state))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(os.path.join(os.path.abspath(path), "params"), target)
    except Exception as e:  # orbax raises many types
        raise CheckpointError(
            restore_failure(f"commit head {path}", e, what="damaged or incomplete")
        ) from None
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(head, state)
    return head
