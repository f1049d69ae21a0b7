"""A bad checkpoint never kills the server: every one below is refused with a reason that names
the problem (and no path, exception class or traceback of ours), the engine stays up, and the
old weights keep serving (the same greedy tokens as before). The same checks guard start-up."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engines import EngineFactory
from safetensors.torch import load_file, save_file
from served import ServeFactory
from tiny_model import make_tiny_model_folder

from shoal import Engine
from shoal.kernels.linear import Linear
from shoal.loading.checkpoint import CheckpointError, read_header
from shoal.models import weights as weights_module
from shoal.models.decoder import DecoderModel
from shoal.models.load import load_model

PROMPT = [5, 17, 200, 33, 91, 7, 64]
WEIGHTS = "model.safetensors"


# ---- bad checkpoints, each a copy of the tiny model with one thing wrong -----------------


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def edit_config(folder: Path, **fields: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


def split_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_safetensors(path: Path, header: Any, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def edit_header(folder: Path, edit: Callable[[dict[str, Any], int], None]) -> None:
    header, data = split_safetensors(folder / WEIGHTS)
    edit(header, len(data))
    write_safetensors(folder / WEIGHTS, header, data)


def edit_tensors(folder: Path, **tensors: torch.Tensor | None) -> None:
    current = load_file(folder / WEIGHTS)
    for name, value in tensors.items():
        name = name.replace("__", ".")
        if value is None:
            del current[name]
        else:
            current[name] = value
    save_file(current, folder / WEIGHTS, metadata={"format": "pt"})


def last_tensor(header: dict[str, Any]) -> str:
    names = [n for n in header if n != "__metadata__"]
    return max(names, key=lambda n: header[n]["data_offsets"][1])


def shard_index(folder: Path, shard_name: str) -> None:
    tensors = load_file(folder / WEIGHTS)
    (folder / WEIGHTS).unlink()
    save_file(tensors, folder / "model-00001-of-00001.safetensors")
    weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
    weight_map["model.norm.weight"] = shard_name
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


Break = Callable[[Path], None]


def _set_dtype(dtype: str) -> Break:
    return lambda f: edit_header(f, lambda h, _: h["model.norm.weight"].update(dtype=dtype))


def _offsets_past_end(folder: Path) -> None:
    def edit(header: dict[str, Any], data_bytes: int) -> None:
        header[last_tensor(header)]["data_offsets"][1] = data_bytes + 4

    edit_header(folder, edit)


def _overlap(folder: Path) -> None:
    def edit(header: dict[str, Any], data_bytes: int) -> None:
        entry = header[last_tensor(header)]
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = [begin - 4, end - 4]

    edit_header(folder, edit)


# (case id, how to break a copy of the tiny model, what the reason must say)
CASES: list[tuple[str, Break, str]] = [
    (
        "config-list",
        lambda f: (f / "config.json").write_text("[1, 2]"),
        "config.json: must be a JSON object, got a list",
    ),
    (
        "layers-null",
        lambda f: edit_config(f, num_hidden_layers=None),
        "config.json: num_hidden_layers must be a positive integer, got null",
    ),
    (
        "layers-string",
        lambda f: edit_config(f, num_hidden_layers="30"),
        'num_hidden_layers must be a positive integer, got "30"',
    ),
    (
        "layers-bool",
        lambda f: edit_config(f, num_hidden_layers=True),
        "num_hidden_layers must be a positive integer, got true",
    ),
    (
        "hidden-negative",
        lambda f: edit_config(f, hidden_size=-64),
        "hidden_size must be a positive integer, got -64",
    ),
    (
        "vocab-float",
        lambda f: edit_config(f, vocab_size=512.0),
        "vocab_size must be a positive integer, got 512.0",
    ),
    (
        "eps-string",
        lambda f: edit_config(f, rms_norm_eps="1e-6"),
        "rms_norm_eps must be a positive number",
    ),
    (
        "tie-int",
        lambda f: edit_config(f, tie_word_embeddings=1),
        "tie_word_embeddings must be true or false, got 1",
    ),
    (
        "eos-out-of-vocab",
        lambda f: edit_config(f, eos_token_id=[2, 9999]),
        "eos_token_id must be a token id",
    ),
    (
        "rope-unknown",
        lambda f: edit_config(f, rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}),
        'rope_type "proportional" is not supported',
    ),
    (
        "generation-list",
        lambda f: (f / "generation_config.json").write_text("[]"),
        "generation_config.json: must be a JSON object",
    ),
    (
        "config-not-json",
        lambda f: (f / "config.json").write_text("{not json"),
        "config.json: the file is not valid JSON",
    ),
    ("config-missing", lambda f: (f / "config.json").unlink(), "missing config.json"),
    ("weights-empty", lambda f: (f / WEIGHTS).write_bytes(b""), f"{WEIGHTS}: the file is empty"),
    (
        "weights-short",
        lambda f: (f / WEIGHTS).write_bytes(b"\x01\x02\x03"),
        f"{WEIGHTS}: the file is only 3 bytes long",
    ),
    (
        "header-garbage",
        lambda f: (f / WEIGHTS).write_bytes(struct.pack("<Q", 16) + b"\xff\xfe garbage {{{{" * 4),
        f"{WEIGHTS}: the header is not valid JSON",
    ),
    (
        "header-too-long",
        lambda f: (f / WEIGHTS).write_bytes(struct.pack("<Q", 10_000) + b"{}"),
        "runs past the end of the file",
    ),
    (
        "header-huge",
        lambda f: (f / WEIGHTS).write_bytes(struct.pack("<Q", 2**63) + b"{}"),
        "over the limit",
    ),
    (
        "header-list",
        lambda f: write_safetensors(f / WEIGHTS, [1, 2], b""),
        f"{WEIGHTS}: the header must be a JSON object, got a list",
    ),
    (
        "metadata-int",
        lambda f: edit_header(f, lambda h, _: h.update(__metadata__={"a": 1})),
        "__metadata__",
    ),
    ("dtype-unknown", _set_dtype("Q4"), 'tensor model.norm.weight has dtype "Q4"'),
    ("dtype-int", _set_dtype("I32"), 'tensor model.norm.weight has dtype "I32"'),
    (
        "shape-not-list",
        lambda f: edit_header(f, lambda h, _: h["model.norm.weight"].update(shape="64")),
        "tensor model.norm.weight has shape",
    ),
    (
        "shape-negative",
        lambda f: edit_header(f, lambda h, _: h["model.norm.weight"].update(shape=[-64])),
        "list of non-negative integers",
    ),
    (
        "shape-wrong",
        lambda f: edit_tensors(f, model__norm__weight=torch.ones(32)),
        "tensor model.norm.weight has shape (32,), expected (64,)",
    ),
    (
        "size-mismatch",
        lambda f: edit_header(f, lambda h, _: h["model.norm.weight"].update(shape=[63])),
        "bytes of data; its dtype and shape need",
    ),
    ("offsets-past-end", _offsets_past_end, "data_offsets"),
    ("offsets-overlap", _overlap, "must not overlap or leave gaps"),
    (
        "trailing-bytes",
        lambda f: (f / WEIGHTS).write_bytes((f / WEIGHTS).read_bytes() + b"\0" * 8),
        "the tensors cover",
    ),
    (
        "tensor-missing",
        lambda f: edit_tensors(f, model__norm__weight=None),
        "the checkpoint is missing tensor model.norm.weight",
    ),
    (
        "tensor-nan",
        lambda f: edit_tensors(f, model__norm__weight=torch.full((64,), float("nan"))),
        "tensor model.norm.weight holds values that are not finite in float32",
    ),
    (
        "tensor-infinite",
        lambda f: edit_tensors(
            f, model__layers__1__mlp__down_proj__weight=torch.full((64, 128), float("inf"))
        ),
        "tensor model.layers.1.mlp.down_proj.weight holds values that are not finite",
    ),
    (
        "tensor-unexpected",
        lambda f: edit_tensors(f, model__extra__weight=torch.ones(4)),
        "the checkpoint has unexpected tensor model.extra.weight",
    ),
    (
        "index-parent-shard",
        lambda f: shard_index(f, "../x"),
        'weight_map[model.norm.weight] names "../x"',
    ),
    (
        "index-absolute-shard",
        lambda f: shard_index(f, "/etc/passwd"),
        "not a file name in the checkpoint folder",
    ),
    (
        "index-missing-shard",
        lambda f: shard_index(f, "other.safetensors"),
        "other.safetensors: the file is missing",
    ),
    (
        "index-list",
        lambda f: (f / "model.safetensors.index.json").write_text("[]"),
        "model.safetensors.index.json: must be a JSON object",
    ),
    (
        "index-map-list",
        lambda f: (f / "model.safetensors.index.json").write_text('{"weight_map": []}'),
        "weight_map must be a non-empty object",
    ),
]


def assert_clean(message: str, *paths: Path) -> None:
    """A reason for the client: no exception class, traceback or absolute path of ours."""
    assert "Error(" not in message and "Traceback" not in message, message
    assert "Error:" not in message, message
    for path in paths:
        assert str(path) not in message, message


async def greedy_tokens(engine: Engine) -> list[int]:
    done = await engine.generate(
        input_ids=PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True
    ).result()
    return list(done.token_ids)


# ---- through the engine ------------------------------------------------------------------


@pytest.mark.parametrize(("case", "damage", "reason"), CASES, ids=[c[0] for c in CASES])
async def test_bad_checkpoint_is_refused_and_old_weights_serve(
    make_engine: EngineFactory,
    tiny_folder: Path,
    tmp_path: Path,
    case: str,
    damage: Break,
    reason: str,
) -> None:
    engine = await make_engine()
    before = await greedy_tokens(engine)
    bad = copy_folder(tiny_folder, tmp_path / "bad")
    damage(bad)
    result = await engine.update_weights_from_disk(bad)
    assert not result.success, case
    assert reason in result.message, result.message
    assert result.message.startswith("could not load the checkpoint: "), result.message
    assert_clean(result.message, tmp_path, tiny_folder)
    assert engine.dead_reason is None
    assert result.weight_version == engine.weight_version == "0"
    assert await greedy_tokens(engine) == before


@pytest.mark.parametrize(
    ("where", "reason"),
    [("missing", "the checkpoint path does not exist"), ("file", "is a file, not a model folder")],
)
async def test_bad_paths_are_refused(
    make_engine: EngineFactory, tiny_folder: Path, tmp_path: Path, where: str, reason: str
) -> None:
    engine = await make_engine()
    before = await greedy_tokens(engine)
    path = tmp_path / where
    if where == "file":
        path.write_text("not a model")
    result = await engine.update_weights_from_disk(path)
    assert not result.success and reason in result.message, result.message
    assert_clean(result.message, tmp_path)
    assert engine.dead_reason is None
    assert await greedy_tokens(engine) == before


async def test_an_unexpected_failure_is_a_refusal_not_a_dead_engine(
    make_engine: EngineFactory,
    tiny_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever goes wrong while loading, the executor answers with a reason and lives."""
    engine = await make_engine()
    before = await greedy_tokens(engine)

    def broken(*args: object, **kwargs: object) -> None:
        raise AttributeError(f"'NoneType' object has no attribute 'x' in {tiny_folder}")

    monkeypatch.setattr("shoal.actors.executor.weight_loads.load_weights", broken)
    with caplog.at_level("ERROR", logger="shoal.executor"):
        result = await engine.update_weights_from_disk(tiny_folder)
    assert not result.success and "could not be read" in result.message, result.message
    assert "NoneType" not in result.message
    assert_clean(result.message, tiny_folder)
    assert any(record.exc_info for record in caplog.records)  # the log keeps the detail
    assert engine.dead_reason is None
    monkeypatch.undo()
    assert await greedy_tokens(engine) == before
    result = await engine.update_weights_from_disk(tiny_folder)
    assert result.success, result.message  # a good checkpoint still loads afterwards


async def other_weights(tmp_path: Path, engine: Engine) -> tuple[Path, list[int]]:
    """A checkpoint of the same architecture with other weights, and its greedy tokens (an
    engine of the same dtype)."""
    folder = make_tiny_model_folder(tmp_path / "other", seed=1)
    loaded = load_model(folder, progress=False)
    reference = await Engine(loaded, seed=0, dtype=engine.options.dtype).start()
    try:
        tokens = await greedy_tokens(reference)
    finally:
        await reference.close()
    assert tokens != await greedy_tokens(engine)
    return folder, tokens


# packed linears; bfloat16 ones (oneDNN, on the CPU); dense ones
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
async def test_a_stage_that_fails_to_build_leaves_the_old_weights_in_every_stage(
    make_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """The second pipeline stage fails to build its part (out of memory, say) after the first
    built its own: the update is refused and both stages serve the old weights, not a mix;
    the same update then goes through."""
    engine = await make_engine(pipeline_stages=2, dtype=dtype)
    before = await greedy_tokens(engine)
    folder, after = await other_weights(tmp_path, engine)
    staged = DecoderModel.stage
    calls: list[int] = []

    def failing_second(self: DecoderModel, weights: dict[str, torch.Tensor]) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of memory")
        return staged(self, weights)

    monkeypatch.setattr(DecoderModel, "stage", failing_second)
    result = await engine.update_weights_from_disk(folder)
    assert not result.success and "could not be read" in result.message, result.message
    assert len(calls) == 2 and engine.dead_reason is None and engine.weight_version == "0"
    assert await greedy_tokens(engine) == before
    monkeypatch.undo()
    result = await engine.update_weights_from_disk(folder)
    assert result.success, result.message
    assert await greedy_tokens(engine) == after


async def test_a_linear_that_fails_to_pack_leaves_every_weight_as_it_was(
    make_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing the new weights fails halfway through the model's linears: none of the first
    half is serving."""
    engine = await make_engine()
    before = await greedy_tokens(engine)
    folder, after = await other_weights(tmp_path, engine)
    make_linear = weights_module.make_linear
    calls: list[int] = []

    def failing_third(*args: Any, **kwargs: Any) -> Linear:
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("out of memory")
        return make_linear(*args, **kwargs)

    monkeypatch.setattr(weights_module, "make_linear", failing_third)
    result = await engine.update_weights_from_disk(folder)
    assert not result.success and engine.dead_reason is None, result.message
    assert len(calls) == 3
    assert await greedy_tokens(engine) == before
    monkeypatch.undo()
    assert (await engine.update_weights_from_disk(folder)).success
    assert await greedy_tokens(engine) == after


# ---- through HTTP: the three failures that used to kill the server ------------------------


HTTP_CASES = [c for c in CASES if c[0] in ("config-list", "layers-null", "weights-empty")]


@pytest.mark.parametrize(("case", "damage", "reason"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
async def test_bad_checkpoint_over_http_answers_400_and_keeps_serving(
    serve: ServeFactory,
    tiny_folder: Path,
    tmp_path: Path,
    case: str,
    damage: Break,
    reason: str,
) -> None:
    s = await serve()
    generate = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    async with s.http.post(s.url + "/generate", json=generate) as resp:
        before = (await resp.json())["output_ids"]
    bad = copy_folder(tiny_folder, tmp_path / "bad")
    damage(bad)
    body = {"model_path": str(bad)}
    async with s.http.post(s.url + "/update_weights_from_disk", json=body) as resp:
        status, refused = resp.status, await resp.json()
    assert status == 400 and refused["success"] is False, refused
    assert reason in refused["message"], refused
    assert_clean(json.dumps(refused), tmp_path, tiny_folder)
    async with s.http.get(s.url + "/health") as resp:
        assert resp.status == 200
    async with s.http.post(s.url + "/generate", json=generate) as resp:
        assert resp.status == 200 and (await resp.json())["output_ids"] == before
    assert s.engine.dead_reason is None


# ---- start-up and the header reader on their own ------------------------------------------


STARTUP = ("config-list", "layers-null", "header-garbage", "dtype-int")
STARTUP_CASES = [c for c in CASES if c[0] in STARTUP]


@pytest.mark.parametrize(
    ("case", "damage", "reason"),
    STARTUP_CASES,
    ids=[c[0] for c in STARTUP_CASES],
)
def test_start_up_refuses_a_bad_checkpoint_with_a_clear_value_error(
    tiny_folder: Path, tmp_path: Path, case: str, damage: Break, reason: str
) -> None:
    bad = copy_folder(tiny_folder, tmp_path / "bad")
    damage(bad)
    with pytest.raises(ValueError, match=r"model folder .*bad: ") as caught:
        load_model(bad, progress=False)
    assert reason in str(caught.value)


def test_header_reader_accepts_the_good_file_and_zero_size_tensors(
    tiny_folder: Path, tmp_path: Path
) -> None:
    entries = read_header(tiny_folder, WEIGHTS)
    assert entries["model.norm.weight"].shape == (64,)
    assert {e.dtype for e in entries.values()} == {"F32"}
    save_file({"a": torch.zeros(0), "b": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "x")
    entries = read_header(tmp_path, "x")
    assert entries["a"].shape == (0,) and entries["b"].dtype == "BF16"


def test_header_reader_names_only_the_relative_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write_safetensors(tmp_path / "sub" / "w.safetensors", {"a": {"dtype": "F32"}}, b"")
    with pytest.raises(CheckpointError) as caught:
        read_header(tmp_path / "sub", "w.safetensors")
    message = str(caught.value)
    assert message.startswith("w.safetensors: tensor a has shape null"), message
    assert str(tmp_path) not in message
