"""The tool warm start (`vlm_grpo.tools.warm_start`), held-out evaluation with tools (`evaluate_with_tools`), the
command's `--warm_start`, and the learning check on the zoom_color task (with tools against without).

Everything runs for real: tiny Qwen3-VL models built in code, their tokenizer and processor, PIL images, the image
tools, TRL's tool loop through `VLMGRPOTrainer`. Where a random model must write a given reply (the rollout compared
with a trace), a `sequence_bias` forces it, as in tests/test_tools.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from vlm_grpo.cli.command import main
from vlm_grpo.cli.task import synthetic_task
from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
from vlm_grpo.media.pixel_budget import pixel_budget_for_call
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.tools import image_tools
from vlm_grpo.tools.warm_start import demonstration_box, tool_trace, tool_warm_start
from vlm_grpo.training.evaluation import evaluate_with_tools
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'environment_factory':UserWarning")

ZOOM = image_tools("zoom")


def test_the_docstring_examples_hold():
    import doctest

    from vlm_grpo.tools import warm_start

    assert doctest.testmod(warm_start).failed == 0


@pytest.fixture(scope="module")
def zoom_rows():
    return make_visual_reasoning_dataset("zoom", 48)


def _forcing(context: list[int], reply: list[int]) -> list:
    """A `sequence_bias` making greedy decoding write `reply` after `context` (token ids): each prefix of it, after
    the context, biased by 2 ** its length, so the longest match wins (as tests/test_tools.py forces replies)."""
    return [[context + reply[: i + 1], 2.0 ** (len(context) + i + 1)] for i in range(len(reply))]


def _tiny(tiny_dir):
    return FastVisionModel.from_pretrained(tiny_dir("qwen3_vl", tools=True, words=answer_words("zoom", 1)),
                                           full_finetuning=True)  # fmt: skip


def test_the_demonstrated_box_holds_the_mark_with_a_margin(zoom_rows):
    for row in zoom_rows:
        x1, y1, x2, y2 = demonstration_box(row["bbox"], (448, 448), (128, 128))
        assert (x2 - x1, y2 - y1) == (32, 32) and x1 % 16 == 0 and y1 % 16 == 0  # a quarter, on a grid of half that
        mark = [v * 128 / 448 for v in row["bbox"]]
        # At least 4 frame pixels (14 of the canvas) clear on every side but an image edge: a box one step off still
        # holds the mark.
        clear = [mark[0] - x1, mark[1] - y1, x2 - mark[2], y2 - mark[3]]
        edge = [x1 == 0, y1 == 0, x2 == 128, y2 == 128]
        assert all(c >= 4 or (at_edge and c >= 0) for c, at_edge in zip(clear, edge, strict=True)), (row["bbox"], x1)


def test_a_mark_in_a_known_place_is_one_shared_call_and_marks_anywhere_share_none(zoom_rows):
    """`shared_call`: zoom_color's dot is always at the centre, so its traces write one call (a tiny model's
    tokenizer makes it one token); the zoom task's marks are anywhere, so they share none."""
    from vlm_grpo.tools.warm_start import shared_call

    dots = make_visual_reasoning_dataset("zoom_color", 8)
    call = shared_call(dots["bbox"], (1024, 1024), (128, 128), 8)
    assert call == {"name": "zoom", "arguments": {"x1": 56, "y1": 56, "x2": 72, "y2": 72, "factor": 8}}
    assert shared_call(zoom_rows["bbox"], (448, 448), (128, 128)) is None
    assert shared_call(zoom_rows["bbox"][:4], (448, 448), (128, 128)) is None
    assert shared_call([zoom_rows["bbox"][0]] * 3 + zoom_rows["bbox"][1:3], (448, 448), (128, 128)) is not None


@pytest.mark.trains
def test_a_trace_is_the_rollout_that_writes_it_token_for_token(tiny_dir, tmp_path, zoom_rows):
    """A rollout forced to write the trace's call and answer: the same prompt and completion tokens, the trace's
    labels exactly the tokens TRL trains (its `tool_mask`), the tool's image in both."""
    model, processor = _tiny(tiny_dir)
    row = dict(zoom_rows[0])
    trainer = VLMGRPOTrainer(model, synthetic_task("zoom", train_size=1, test_size=1).reward_funcs,
                             args=_config(tmp_path), train_dataset=zoom_rows, processing_class=processor,
                             environment_factory=ZOOM)  # fmt: skip
    with pixel_budget_for_call(processor) as budget:
        trace = tool_trace(row, processor, ZOOM, budget=budget)
    tok = processor.tokenizer
    ids, labels = trace["input_ids"].tolist(), trace["labels"].tolist()
    trained = [i for i, label in enumerate(labels) if label != -100]
    call_end = next(i for i in trained if ids[i] == tok.eos_token_id)
    prompt_end = trained[0]
    call, answer = tok.decode(ids[prompt_end : call_end + 1]), tok.decode([ids[i] for i in trained if i > call_end])
    assert call.startswith("<tool_call>\n") and '"name": "zoom"' in call and answer == f"{row['answer']}<|im_end|>"
    # Forced: the call after the question, the answer after the tool's turn, token for token.
    answer_start = next(i for i in trained if i > call_end)
    trainer.generation_config.sequence_bias = _forcing(
        ids[prompt_end - 6 : prompt_end], ids[prompt_end : call_end + 1]
    ) + _forcing(ids[answer_start - 6 : answer_start], ids[answer_start:])
    trainer.generation_config.do_sample = False
    out = trainer._generate_and_score_completions([row, row])  # one group of two rollouts
    prompt = out["prompt_ids"][0][out["prompt_mask"][0].bool()].tolist()
    completion = out["completion_ids"][0][out["completion_mask"][0].bool()].tolist()
    assert prompt + completion == ids
    mask = out["tool_mask"][0][: len(completion)].tolist()
    assert [i + len(prompt) for i, m in enumerate(mask) if m] == trained
    assert out["num_images"] == [2, 2] and out["image_grid_thw"].tolist() == trace["image_grid_thw"].tolist() * 2
    assert torch.equal(out["pixel_values"][: len(trace["pixel_values"])], trace["pixel_values"])


def _config(tmp_path, **kwargs):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
                    max_completion_length=192, max_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                    disable_tqdm=True, seed=0, max_tool_calling_iterations=1, beta=0.0)  # fmt: skip
    return VLMGRPOConfig(**{**settings, **kwargs})


def test_traces_without_the_mark_box_or_zoom_are_refused_with_the_fix(tiny_dir, zoom_rows):
    _, processor = _tiny(tiny_dir)
    row = {k: v for k, v in dict(zoom_rows[0]).items() if k != "bbox"}
    with pytest.raises(ValueError, match="needs the mark's box in a `bbox` column"):
        tool_trace(row, processor, ZOOM)
    with pytest.raises(ValueError, match="calls `zoom`: give an environment with it, e.g. image_tools"):
        tool_trace(dict(zoom_rows[0]), processor, image_tools("crop"))
    assert (tool_trace(row, processor, None)["labels"] != -100).sum() == 2  # no tools: the answer and its end


def test_a_trace_renders_its_turns_with_the_trainers_template_arguments(tiny_dir, zoom_rows):
    """`chat_template_kwargs` (e.g. Qwen3.5's `enable_thinking`) reach the trace's prompt and the tool turn's next
    generation prompt, as they reach the rollouts' (the warm start rendered without them)."""
    _, processor = FastVisionModel.from_pretrained(tiny_dir("qwen3_5", tools=True, words=answer_words("zoom", 1)),
                                                   full_finetuning=True)  # fmt: skip
    tok = processor.tokenizer
    for thinking, opening in ((True, "<think>\n"), (False, "<think>\n\n</think>\n\n")):
        trace = tool_trace(dict(zoom_rows[0]), processor, ZOOM, chat_template_kwargs={"enable_thinking": thinking})
        ids, trained = trace["input_ids"].tolist(), (trace["labels"] != -100).tolist()
        starts = [i for i in range(len(ids)) if trained[i] and not trained[i - 1]]  # the call's and the answer's
        assert len(starts) == 2
        for start in starts:
            assert tok.decode(ids[:start]).endswith("<|im_start|>assistant\n" + opening), (thinking, start)


@pytest.mark.trains
def test_the_warm_start_lowers_the_loss_on_the_models_own_tokens(tiny_dir, zoom_rows):
    model, processor = _tiny(tiny_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = tool_warm_start(model, processor, zoom_rows, 6, ZOOM, batch_size=4, learning_rate=3e-3)
    assert (done.steps, done.traces) == (6, 24) and done.last_loss < done.first_loss - 1.0  # nats per token
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training  # the mode it was found in


@pytest.mark.trains
def test_evaluation_with_tools_rolls_out_through_the_tool_loop(tiny_dir, tmp_path, zoom_rows):
    """Held-out accuracy with tools: each row rolled out once by the trainer's tool loop, greedily; here every rollout
    is forced to zoom and answer 'circle', so the accuracy is the share of circles."""
    model, processor = _tiny(tiny_dir)
    task = synthetic_task("zoom", train_size=1, test_size=1)
    trainer = VLMGRPOTrainer(model, task.reward_funcs, args=_config(tmp_path), train_dataset=zoom_rows,
                             processing_class=processor, environment_factory=ZOOM)  # fmt: skip
    tok = processor.tokenizer
    call = (
        '<tool_call>\n{"name": "zoom", "arguments": {"x1": 0, "y1": 0, "x2": 32, "y2": 32, "factor": 4}}\n</tool_call>'
    )

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    trainer.generation_config.sequence_bias = _forcing(
        ids(".<|im_end|>\n<|im_start|>assistant\n"), ids(call + "<|im_end|>")
    ) + _forcing(ids("</tool_response><|im_end|>\n<|im_start|>assistant\n"), ids("circle<|im_end|>"))
    rows = zoom_rows.select(range(6))
    sampling = trainer.generation_config.do_sample
    metrics = evaluate_with_tools(trainer, rows, task.eval_funcs, batch_size=4)
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert metrics["accuracy"] == pytest.approx(sum(a == "circle" for a in rows["answer"]) / 6)
    assert trainer.generation_config.do_sample == sampling and trainer.model.training  # given back
    # A box reaching outside the image: TRL answers with the tool's error, counted as a failed call.
    outside = call.replace('"x2": 32', '"x2": 300')
    trainer.generation_config.sequence_bias = _forcing(
        ids(".<|im_end|>\n<|im_start|>assistant\n"), ids(outside + "<|im_end|>")
    )
    metrics = evaluate_with_tools(trainer, rows.select(range(2)), task.eval_funcs)
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 1.0
    with pytest.raises(ValueError, match="needs a trainer given tools or an environment_factory; use evaluate"):
        plain = VLMGRPOTrainer(model, task.reward_funcs, args=_config(tmp_path), train_dataset=zoom_rows,
                               processing_class=processor)  # fmt: skip
        evaluate_with_tools(plain, rows, task.eval_funcs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--warm_start", "-1"], "--warm_start is a number of steps >= 0, got -1"),
        (["--warm_start", "4", "--task", "motion"], "--warm_start makes traces of image rows, not clips"),
        (["--warm_start", "4", "--tools", "zoom", "--max_completion_length", "256"],
         "only the zoom tasks' rows locate; use --task zoom or --task zoom_color"),
        (["--warm_start", "4", "--tools", "crop", "--task", "zoom", "--max_completion_length", "256"],
         "--warm_start with --tools calls zoom: add it"),
    ],
)  # fmt: skip
def test_a_bad_warm_start_is_one_line_and_exit_status_2(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert main(["--output_dir", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlm-grpo: error:") and message in err and "\n" not in err, err
    assert not out.exists()


@pytest.mark.trains
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_the_kl_reference_is_the_warm_started_model(tmp_path, capsys, peft):
    """TRL builds a fully trained model's KL reference again from its config's path: the command saves the
    warm-started model and points there. With LoRA the reference is the adapter off: the warm-started adapter is
    folded into the base and started afresh. Either way GRPO's first step measures no KL (the policy is its
    reference); from the model before the warm start, the KL would pull the policy back to what it was taught away
    from."""
    out = tmp_path / "run"
    assert main(["--model", "tiny:qwen3_vl", "--task", "zoom_color", "--tools", "zoom", "--warm_start", "3",
                 "--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2", "--train_size",
                 "8", "--test_size", "1", "--beta", "0.04", "--output_dir", str(out),
                 *(["--use_peft"] if peft else [])]) == 0  # fmt: skip
    (first,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"kl"' in line]
    assert first["kl"] < 1e-6, first["kl"]
    assert (out / "warm-start" / "config.json").exists()
    if peft:  # final/ is an adapter on the folded, warm-started base: saved, and named as its base
        config = json.loads((out / "final" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(out / "warm-start")
        from safetensors.torch import load_file

        def weights(folder):
            return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

        started, folded = weights(out / "tiny-base"), weights(out / "warm-start")
        assert started.keys() == folded.keys() and any(not torch.equal(started[k], folded[k]) for k in started)
    said = capsys.readouterr()
    assert ("adapter folded into the base weights" in said.out) == peft and "KL reference is the model" not in said.err


def test_folding_an_adapter_keeps_the_function_and_makes_it_the_adapter_off_model(tiny_dir):
    """`fold_adapters`: the trained adapter's update moves into the base weights (fp32: the same logits), the adapter
    starts afresh (every lora_B zero), and the adapter-off model, the KL reference, computes what the trained one did."""
    from vlm_grpo.tools.warm_start import fold_adapters

    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    model = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=False, random_state=0)
    with torch.no_grad():  # a "warm-started" adapter: every B moved
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        with model.disable_adapter():
            before = model(input_ids=ids).logits
    assert (trained - before).abs().max() > 1e-3  # the adapter does something to fold
    assert fold_adapters(model) > 0
    with torch.no_grad():
        folded = model(input_ids=ids).logits
        with model.disable_adapter():
            reference = model(input_ids=ids).logits
    assert torch.allclose(folded, trained, atol=1e-5) and torch.allclose(reference, trained, atol=1e-5)
    assert all(not p.any() for n, p in model.named_parameters() if "lora_B" in n)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # still the adapter GRPO trains


# The learning check (issue 47): a run with tools and one without, the same steps, on zoom_color (the colour of a dot
# that the prompt's 128 x 128 image does not show at all, and `zoom(56, 56, 72, 72, factor=8)` shows at full size).
# The warm start teaches the call (one token of the tiny tokenizer) and reading the zoom; GRPO, at a small learning
# rate, keeps them while it samples. About 2 minutes on one free core (docs/tools.md has the measured numbers).
LEARNING = ["--model", "tiny:qwen3_vl", "--task", "zoom_color", "--warm_start", "200", "--max_steps", "8",
            "--per_device_train_batch_size", "16", "--num_generations", "4", "--learning_rate", "1e-4",
            "--train_size", "256", "--test_size", "128", "--logging_steps", "1", "--disable_tqdm", "true"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.trains
def test_a_model_taught_to_zoom_reads_the_dot_and_one_without_tools_stays_at_chance(tmp_path):
    """Issue 47's bar: after the warm start and GRPO with tools, held-out accuracy with tools >= 0.8; the same steps
    without tools (a warm start that answers at once, then GRPO) within 0.1 of chance. Real runs of the command."""
    runs, steps = {}, {}
    for arm, extra in (("tools", ["--tools", "zoom"]), ("plain", [])):
        out = tmp_path / arm
        assert main([*LEARNING, *extra, "--output_dir", str(out)]) == 0
        runs[arm] = json.loads((out / "eval.json").read_text())
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps[arm] = [line for line in lines if "kl" in line]
    tools, plain, chance = runs["tools"], runs["plain"], 0.25
    report = {arm: {k: round(v, 3) for k, v in run.items() if "accuracy" in k} for arm, run in runs.items()}
    assert tools["after/with_tools/accuracy"] >= 0.8, report
    assert (
        tools["after/with_tools/tools/call_frequency"] >= 0.9 and tools["after/with_tools/tools/failure_frequency"] == 0
    )
    assert abs(plain["after/accuracy"] - chance) <= 0.1, report
    # GRPO with tools stays sane while it samples at temperature 1: the KL to the warm-started model small, most
    # sampled calls whole (the first attempt's went to KL 5.9 and 85% malformed in 5 steps).
    assert len(steps["tools"]) == 8 and max(step["kl"] for step in steps["tools"]) < 0.1, steps["tools"]
    malformed = [step["tools/malformed_frequency"] for step in steps["tools"]]
    assert sum(malformed) / len(malformed) < 0.3, malformed
