import math

import pytest
from conftest import guarded_model_dir

from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.rewards import make_choice_reward
from vlm_grpo.training.evaluation import evaluate, pass_at_k, sample_completions


def test_pass_at_k_matches_the_combinatorial_definition():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(5, 3, 3) == 1.0  # fewer wrong samples than k: some draw must be right
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_evaluate_scores_generations_with_the_rewards(tiny_dir):
    words = answer_words("color", 1)
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=words))
    dataset = make_visual_reasoning_dataset("color", 6, seed=0, split="test")
    seen, sizes = [], []

    def always_right(prompts, completions, answer, **kwargs):
        seen.append((len(completions), list(answer)))
        sizes.extend(zip(kwargs["source_image_size"], kwargs["fed_image_size"], strict=True))
        return [1.0] * len(completions)

    def never(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    result = evaluate(
        model, processor, dataset, [always_right, never], num_generations=4, max_new_tokens=3, batch_size=4
    )
    assert result["accuracy"] == 1.0 and result["pass@1"] == 1.0 and result["pass@4"] == 1.0
    assert result["reward/always_right"] == 1.0 and result["reward/never"] == 0.0 and result["mean_reward"] == 0.5
    assert [n for n, _ in seen] == [16, 8]  # 4 + 2 rows, 4 samples each
    assert seen[0][1][:4] == [dataset[0]["answer"]] * 4  # columns are repeated per sample, in order
    # Grounding rewards get each image's size as stored and as the processor fed it (56 px is already a multiple of 28).
    assert sizes == [((56, 56), (56, 56))] * 24
    assert not model.training  # was in eval mode before, stays there


def test_evaluate_budget_holds_for_the_call_only(tiny_dir):
    from vlm_grpo.media.pixel_budget import processor_pixel_budget

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    before = processor_pixel_budget(processor)
    fed = []

    def record(prompts, completions, fed_image_size, **kwargs):
        fed.extend(fed_image_size)
        return [0.0] * len(completions)

    dataset = make_visual_reasoning_dataset("color", 2)
    evaluate(model, processor, dataset, [record], max_new_tokens=1, max_pixels=28 * 28)
    assert fed == [(28, 28)] * 2  # the 56x56 images were fed at the call's budget
    assert processor_pixel_budget(processor) == before  # and the processor has its own budget back


def test_accuracy_and_pass_at_k_count_each_rows_own_samples(tiny_dir):
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=answer_words("color", 1)))
    correct = [0, 1, 2, 3, 4, 2]  # right samples of each row's 4
    dataset = make_visual_reasoning_dataset("color", 6, seed=0, split="test").add_column("correct", correct)

    def first_samples_right(prompts, completions, correct, **kwargs):
        # The samples of a row come together (batches hold whole rows): the first `correct` of each 4 are right.
        return [1.0 if i % 4 < c else 0.0 for i, c in enumerate(correct)]

    result = evaluate(model, processor, dataset, [first_samples_right], num_generations=4, max_new_tokens=2,
                      batch_size=4)  # fmt: skip
    assert result["accuracy"] == sum(correct) / 24
    for k in (1, 2, 4):
        assert result[f"pass@{k}"] == pytest.approx(sum(pass_at_k(4, c, k) for c in correct) / 6)
    assert result["pass@2"] == pytest.approx((0 + 0.5 + 5 / 6 + 1 + 1 + 5 / 6) / 6)  # the definition, by hand


def test_evaluate_needs_a_reward(tiny_dir):
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    with pytest.raises(ValueError, match="at least one reward"):
        evaluate(model, processor, make_visual_reasoning_dataset("color", 2), [])


def test_package_level_evaluate_is_the_function_even_after_submodule_imports():
    import vlm_grpo
    import vlm_grpo.cli.command  # imports vlm_grpo.training.evaluation
    from vlm_grpo.training.evaluation import evaluate as function

    assert vlm_grpo.evaluate is function and callable(vlm_grpo.evaluate)


def test_sample_completions_are_the_greedy_answers_that_evaluate_scores(tiny_dir):
    words = answer_words("color", 1)
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=words))
    dataset = make_visual_reasoning_dataset("color", 5, seed=0, split="test")
    reward = make_choice_reward(words)
    samples = sample_completions(model, processor, dataset, [reward], max_new_tokens=3, batch_size=2)
    assert len(samples) == 5 and all(set(s) == {"completion", "choice_accuracy"} for s in samples)
    # Each score is the reward of that completion for that row, and their mean is evaluate's greedy accuracy.
    assert [s["choice_accuracy"] for s in samples] == reward(
        prompts=None, completions=[s["completion"] for s in samples], answer=dataset["answer"]
    )
    accuracy = evaluate(model, processor, dataset, [reward], max_new_tokens=3)["accuracy"]
    assert sum(s["choice_accuracy"] for s in samples) / 5 == pytest.approx(accuracy)
    assert sample_completions(model, processor, dataset.select(range(2)), max_new_tokens=3) == [
        {"completion": s["completion"]} for s in samples[:2]
    ]  # no rewards: completions only


def test_evaluate_leaves_the_callers_random_stream_where_it_was(tiny_dir):
    # evaluate() seeds its own sampling; a training run that evaluates mid-way must draw the same numbers afterwards.
    import torch

    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    dataset = make_visual_reasoning_dataset("color", 2)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    evaluate(model, processor, dataset, [lambda completions, **kw: [0.0] * len(completions)], num_generations=2,
             max_new_tokens=2)  # fmt: skip
    assert torch.equal(torch.rand(3), expected)


def test_the_chat_template_arguments_reach_the_held_out_prompts(tiny_dir, tmp_path):
    model, processor = FastVisionModel.from_pretrained(guarded_model_dir(tiny_dir, tmp_path))
    dataset = make_visual_reasoning_dataset("color", 2, seed=0, split="test")

    def never(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(Exception, match="did not reach it"):  # the guard holds
        evaluate(model, processor, dataset, [never], max_new_tokens=2)
    result = evaluate(model, processor, dataset, [never], max_new_tokens=2, chat_template_kwargs={"marker": True})
    assert result["accuracy"] == 0.0
    samples = sample_completions(model, processor, dataset, [never], max_new_tokens=2,
                                 chat_template_kwargs={"marker": True})  # fmt: skip
    assert len(samples) == 2
