"""Checkpoint files: atomic publication, pruning, failed and killed saves, damaged or foreign checkpoints,
safe loading, asynchronous saves, full checkpoints and SMP's older save/load.

Every failure must reach every rank as the same one-line CheckpointError, never a hang or a partial load.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

import shardwise as sw
from shardwise.checkpoint.directory import read_manifest, write_manifest
from shardwise.checkpoint.sources import read_everything, walk
from shardwise.checkpoint.storage import checksum
from shardwise.testing import DistributedTestError, run_distributed
from tiny_models import build, dataset, make_optimizer, seed_step


def setup(config: dict):
    """A tiny GPT-2 and AdamW under `config`, and a function that trains one step."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    train_step = seed_step("gpt2")
    batches = iter(sw.data_loader(dataset("gpt2", 64), batch_size=2, shuffle=False))

    def step() -> None:
        optimizer.zero_grad()
        train_step(model, *next(batches))
        optimizer.step()

    return model, optimizer, step


def whole(model) -> dict:
    return {name: value.clone() for name, value in model.full_state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def error_of(action) -> str:
    """The CheckpointError `action` raises (it must raise one), as its message."""
    try:
        action()
    except sw.CheckpointError as error:
        return str(error)
    raise AssertionError("no CheckpointError")


def on_first(action) -> None:
    """`action` on rank 0 while the others wait (damage done to the files between two calls)."""
    if dist.get_rank() == 0:
        action()
    dist.barrier()


# --- publication, pruning, failed and killed saves ---------------------------------------------------------------

def save_four_keep_two(path: str) -> list[str]:
    _, _, step = setup({})
    for number in range(1, 5):
        step()
        sw.save_checkpoint(path, f"step{number}", num_kept_partial_checkpoints=2)
    sw.shutdown()
    return sorted(os.listdir(path))


def test_newest_moves_last_and_old_partial_checkpoints_are_pruned(tmp_path):
    for listing in run_distributed(save_four_keep_two, 2, str(tmp_path), timeout=300):
        assert listing == ["newest", "step3", "step4"]
    assert (tmp_path / "newest").read_text().strip() == "step4"
    manifest = read_manifest(tmp_path / "step4")
    assert manifest["partial"] and manifest["world_size"] == 2 and manifest["checksums"]


def failing_disk(path: str) -> dict:
    model, _, step = setup({})
    step()
    sw.save_checkpoint(path, "step1")
    saved = whole(model)
    step()
    original = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, plan, planner)

    FileSystemWriter.write_data = full_disk
    try:
        message = error_of(lambda: sw.save_checkpoint(path, "step2"))
    finally:
        FileSystemWriter.write_data = original
    listing = sorted(os.listdir(path))
    sw.resume_from_checkpoint(path)
    resumed = same(whole(model), saved)
    sw.shutdown()
    return {"message": message, "listing": listing, "resumed": resumed}


def test_a_failed_write_keeps_the_previous_checkpoint_and_says_so(tmp_path):
    results = run_distributed(failing_disk, 2, str(tmp_path), timeout=300)
    for result in results:
        assert result["message"] == results[0]["message"]
        assert "'step2' was not written" in result["message"] and "No space left" in result["message"]
        assert "'step1'" in result["message"] and "intact" in result["message"]
        assert "\n" not in result["message"]
        assert result["listing"] == ["newest", "step1"] and result["resumed"]


def killed_while_saving(path: str) -> None:
    _, _, step = setup({})
    step()
    sw.save_checkpoint(path, "step1")
    step()
    original = FileSystemWriter.write_data

    def die(self, plan, planner):
        if dist.get_rank() == 1:
            os._exit(9)
        return original(self, plan, planner)

    FileSystemWriter.write_data = die
    sw.save_checkpoint(path, "step2")


def resume_and_save_again(path: str) -> list[str]:
    _, _, step = setup({})
    sw.resume_from_checkpoint(path)
    step()
    sw.save_checkpoint(path, "step2")
    sw.shutdown()
    return sorted(os.listdir(path))


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(DistributedTestError):
        run_distributed(killed_while_saving, 2, str(tmp_path), timeout=60)
    assert (tmp_path / "newest").read_text().strip() == "step1"
    assert not (tmp_path / "step2").exists()
    assert run_distributed(resume_and_save_again, 2, str(tmp_path), timeout=300)[0] == ["newest", "step1", "step2"]


# --- damaged, foreign and unsafe checkpoints ---------------------------------------------------------------------

class Unsafe:
    """Not a type weights-only loading accepts."""


def _shard(directory: Path) -> Path:
    return sorted(directory.glob("*.distcp"))[0]


def _truncate(directory: Path) -> None:
    shard = _shard(directory)
    shard.write_bytes(shard.read_bytes()[:-100])


def _alter(directory: Path) -> None:
    shard = _shard(directory)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _plant_code(directory: Path) -> None:
    """A `.metadata` that would run code when unpickled, with its checksum updated so only the unpickler
    can stop it."""
    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {directory / 'pwned'}",))

    (directory / ".metadata").write_bytes(pickle.dumps(Exploit()))
    _rechecksum(directory, ".metadata")


def _rechecksum(directory: Path, name: str) -> None:
    """Record a rewritten file's checksum in the manifest, as if the checkpoint had been saved so."""
    manifest = read_manifest(directory)
    manifest["checksums"][name] = checksum(directory / name)
    write_manifest(directory, **{k: v for k, v in manifest.items() if k not in ("format", "version", "saved_at")})


def damaged_checkpoints(path: str) -> dict:
    root = Path(path)
    model, _, step = setup({})
    step()
    for tag in ("good", "truncated", "altered", "no_metadata", "no_shard", "code"):
        sw.save_checkpoint(path, tag, user_content=Unsafe() if tag == "good" else None)
    on_first(lambda: (_truncate(root / "truncated"), _alter(root / "altered"),
                      (root / "no_metadata" / ".metadata").unlink(), _shard(root / "no_shard").unlink(),
                      _plant_code(root / "code")))
    messages = {tag: error_of(lambda tag=tag: sw.resume_from_checkpoint(path, tag))
                for tag in ("truncated", "altered", "no_metadata", "no_shard", "code", "unknown", "good")}
    trusted = sw.resume_from_checkpoint(path, "good", trusted_user_content=True)
    messages["pwned"] = (root / "code" / "pwned").exists()
    messages["trusted"] = type(trusted).__name__
    sw.shutdown()
    return messages


def test_damaged_or_unsafe_checkpoints_are_refused_on_every_rank(tmp_path):
    results = run_distributed(damaged_checkpoints, 2, str(tmp_path), timeout=300)
    assert results[0] == results[1]
    found = results[0]
    assert "truncated" in found["truncated"] and ".distcp" in found["truncated"]
    assert "altered" in found["altered"]
    assert ".metadata is missing" in found["no_metadata"]
    assert ".distcp is missing" in found["no_shard"]
    assert "not part of a checkpoint's metadata" in found["code"] and not found["pwned"]
    assert "no checkpoint tagged 'unknown'" in found["unknown"]
    assert "trusted_user_content=True" in found["good"] and found["trusted"] == "Unsafe"
    assert all("\n" not in message for message in found.values() if isinstance(message, str))


def foreign_model(path: str) -> dict:
    model, optimizer, step = setup({})
    step()
    sw.save_checkpoint(path, "small", model=model)
    wider = sw.DistributedModel(build("gpt2", freeze_key_bias=True, hidden=64))
    shape = error_of(lambda: sw.resume_from_checkpoint(path, model=wider))
    on_first(lambda: _drop_entry(Path(path) / "small"))
    missing = error_of(lambda: sw.resume_from_checkpoint(path, model=model))
    sw.shutdown()
    return {"shape": shape, "missing": missing}


def _drop_entry(directory: Path) -> None:
    """Rewrite the checkpoint without the final layer norm's weight (as another model would have none)."""
    everything = read_everything(directory)
    del everything["model"]["transformer.ln_f.weight"]
    shutil.rmtree(directory)
    import torch.distributed.checkpoint as dcp

    dcp.save(everything, checkpoint_id=str(directory), no_dist=True)
    files = sorted(entry.name for entry in directory.iterdir())
    write_manifest(directory, tag="small", partial=True, world_size=2, checksums={
        name: checksum(directory / name) for name in files})


def test_a_checkpoint_of_another_model_is_named_as_such(tmp_path):
    for result in run_distributed(foreign_model, 2, str(tmp_path), timeout=300):
        assert "shape" in result["shape"] and "another model" in result["shape"]
        assert "missing transformer.ln_f.weight" in result["missing"] and "strict=False" in result["missing"]


# --- asynchronous, full and SMP's older checkpoints --------------------------------------------------------------

def async_then_sync(path: str) -> bool:
    model, _, step = setup({"sharded_data_parallel_degree": 2})
    step()
    sw.save_checkpoint(path + "/sync", "step1")
    original = FileSystemWriter.write_data

    def slow_disk(self, plan, planner):
        time.sleep(2)
        return original(self, plan, planner)

    FileSystemWriter.write_data = slow_disk
    try:
        sw.save_checkpoint(path + "/async", "step1", async_save=True)
        step()  # trains while the files are written
        overlapped = not os.path.exists(path + "/async/step1")
        sw.save_checkpoint(path + "/async", "step2", async_save=True)  # waits for the first
        published_first = os.path.exists(path + "/async/step1")
        step()
        sw.shutdown()  # waits for the second
    finally:
        FileSystemWriter.write_data = original
    return overlapped and published_first


def test_an_asynchronous_save_overlaps_training_and_equals_a_synchronous_one(tmp_path):
    assert all(run_distributed(async_then_sync, 2, str(tmp_path), timeout=300))
    assert (tmp_path / "async" / "newest").read_text().strip() == "step2"
    expected = dict(walk(read_everything(tmp_path / "sync" / "step1")))
    actual = dict(walk(read_everything(tmp_path / "async" / "step1")))
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert torch.equal(value, actual[key]) if torch.is_tensor(value) else value == actual[key], key


def full_checkpoint(path: str, config: dict, save: bool) -> dict:
    model, _, step = setup(config)
    if save:
        step()
        sw.save_checkpoint(path, "full", partial=False)
    else:
        assert "partial=False" in error_of(lambda: sw.resume_from_checkpoint(path))
        sw.resume_from_checkpoint(path, partial=False)
    state = whole(model)
    sw.shutdown()
    return state


def test_a_full_checkpoint_loads_in_plain_pytorch_and_in_another_layout(tmp_path):
    saved = run_distributed(full_checkpoint, 2, str(tmp_path), {"shard_optimizer_state": True}, True,
                            timeout=300)[0]
    plain = build("gpt2", freeze_key_bias=True)
    plain.load_state_dict(torch.load(tmp_path / "full" / "model.pt", weights_only=True))
    assert same({k: v for k, v in plain.state_dict().items() if k in saved}, saved)
    resumed = run_distributed(full_checkpoint, 2, str(tmp_path), {"sharded_data_parallel_degree": 2}, False,
                              timeout=300)[0]
    assert same(resumed, saved)


def strip_module_prefix(state: dict) -> dict:
    return {name.removeprefix("module."): value for name, value in state.items()}


def translated_full(path: str) -> dict:
    model, _, _ = setup({"sharded_data_parallel_degree": 2})
    untranslated = error_of(lambda: sw.resume_from_checkpoint(path, partial=False))
    sw.resume_from_checkpoint(path, partial=False, translate_function=strip_module_prefix)
    state = whole(model)
    sw.shutdown()
    return {"untranslated": untranslated, "state": state}


def test_translate_function_maps_a_full_checkpoints_names(tmp_path):
    """A full checkpoint whose names carry a wrapper's `module.` prefix loads once translated."""
    saved = run_distributed(full_checkpoint, 2, str(tmp_path), {}, True, timeout=300)[0]
    directory = tmp_path / "full"
    weights = torch.load(directory / "model.pt", weights_only=True)
    torch.save({f"module.{name}": value for name, value in weights.items()}, directory / "model.pt")
    _rechecksum(directory, "model.pt")
    result = run_distributed(translated_full, 2, str(tmp_path), timeout=300)[0]
    assert "unexpected module." in result["untranslated"]
    assert same(result["state"], saved)


def older_smp_calls(path: str, config: dict) -> bool:
    model, optimizer, step = setup(config)
    step()
    sw.save({"model": model.local_state_dict(), "optimizer": optimizer.local_state_dict()}, path)
    saved = whole(model)
    step()
    state = sw.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    restored = same(whole(model), saved)
    sw.shutdown()
    return restored


@pytest.mark.parametrize("config", [{"sharded_data_parallel_degree": 2}, {"tensor_parallel_degree": 2}],
                         ids=["zero3", "tp"])
def test_older_smp_save_and_load_of_local_state_dicts(tmp_path, config):
    assert all(run_distributed(older_smp_calls, 2, str(tmp_path / "ckpt.pt"), config, timeout=300))


# --- the directory after saves killed part way --------------------------------------------------------------------

def test_a_save_killed_between_its_renames_still_resumes_and_stale_writes_go():
    import tempfile

    from shardwise.checkpoint.directory import publish, resolve, start_writing

    root = Path(tempfile.mkdtemp())
    write_manifest(start_writing(root, "step1"), tag="step1", partial=True, checksums={})
    publish(root, "step1")
    (root / "step1").rename(root / ".replaced-step1")  # killed re-saving step1: the old copy set aside
    assert resolve(root, None) == root / ".replaced-step1"
    (root / ".writing-step7").mkdir()  # left by a save killed while writing
    start_writing(root, "step2")
    assert not (root / ".writing-step7").exists() and (root / ".writing-step2").is_dir()


def save_in_a_smaller_world(path: str) -> None:
    _, _, step = setup({})
    step()
    sw.save_checkpoint(path, "step1")
    sw.shutdown()


def resume_in_a_larger_world(path: str) -> list[str]:
    import warnings

    model, optimizer, _ = setup({})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sw.resume_from_checkpoint(path)
    sw.shutdown()
    return [str(w.message) for w in caught if "RNG states" in str(w.message)]


def test_a_larger_world_says_which_random_streams_it_could_not_restore(tmp_path):
    run_distributed(save_in_a_smaller_world, 1, str(tmp_path), timeout=300)
    said = run_distributed(resume_in_a_larger_world, 2, str(tmp_path), timeout=300)
    assert said[0] == ["the checkpoint holds RNG states for 1 ranks, this world has 2: the others keep the random "
                       "streams the script seeded"]
    assert said[1] == []


def model_config_in_user_content(path: str) -> str:
    """Training scripts keep their Hugging Face model config and NumPy counts in user_content (SMP's examples
    do): they come back without trusted_user_content, while other objects still need it."""
    import numpy
    from transformers import GPT2Config

    model, optimizer, _ = setup({})
    sw.save_checkpoint(path, "config", user_content={"model_config": GPT2Config(n_layer=3), "step": numpy.int64(1),
                                                     "rate": numpy.float32(0.5)})
    content = sw.resume_from_checkpoint(path)
    sw.shutdown()
    return (f"{type(content['model_config']).__name__} {content['model_config'].n_layer} {content['step']!r} "
            f"{content['rate']!r}")


def test_a_hugging_face_config_and_numpy_scalars_in_user_content_load_weights_only(tmp_path):
    assert run_distributed(model_config_in_user_content, 1, str(tmp_path), timeout=300) == [
        "GPT2Config 3 np.int64(1) np.float32(0.5)"]
