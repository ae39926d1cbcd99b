"""`vlm_grpo.engine.compiled_layers`: the layers' attention and MLP compiled for the training forward and backward give
the eager loss and every gradient, with one graph per module class whatever the depth, and only with gradients on."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from test_shared_prefix import COLORS, _batch, _rows, _trainer, _zero_reward
from torch._dynamo.utils import counters

from vlm_grpo.engine.compiled_layers import (
    _SPLIT_SAID,
    COMPILED_CHILDREN,
    CompiledLayers,
    _TrainingForward,
    detach_all,
    is_training_forward,
    unsupported_reason,
)
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer


def _loss_and_grads(trainer, inputs):
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _eager_baseline(tiny_dir, tmp_path, family):
    """A LoRA (both towers), checkpointed trainer of `family`, TRL's batch for it, and its eager loss and gradients."""
    trainer = _trainer(tiny_dir, tmp_path, family, lora="both", gc=True)
    inputs = _batch(trainer, family)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train; the loss normalises by it
    return (trainer, inputs, *_loss_and_grads(trainer, inputs))


def _assert_the_eager_loss_and_gradients(loss, grads, eager_loss, eager):
    assert torch.isfinite(loss) and abs(loss - eager_loss) <= 1e-5 * abs(eager_loss) + 1e-7
    assert set(grads) == set(eager)
    for name, grad in eager.items():
        assert grad.norm() > 0, name
        assert (grads[name] - grad).norm() <= 1e-4 * grad.norm(), name


def _assert_no_call_without_gradients(trainer, inputs):
    calls = counters["stats"]["calls_captured"]
    with torch.no_grad():
        trainer.compute_loss(trainer.model, inputs)
    assert counters["stats"]["calls_captured"] == calls


@pytest.mark.trains
def test_loss_and_every_gradient_match_the_eager_layers(tiny_dir, tmp_path, fresh_dynamo):
    # LoRA on the vision tower and the language model, checkpointing on: the recomputation in backward calls the
    # compiled modules again.
    trainer, inputs, eager_loss, eager = _eager_baseline(tiny_dir, tmp_path, "qwen2_5_vl")
    assert not counters["stats"]["unique_graphs"]
    compiled = CompiledLayers()
    count = compiled.attach(trainer.model, unit="modules")
    vision_blocks = trainer.model.config.vision_config.depth
    text_layers = trainer.model.config.get_text_config().num_hidden_layers
    assert count == 2 * text_layers + vision_blocks  # decoder attention and MLP, vision MLP (its attention reads
    assert compiled.attach(trainer.model, unit="modules") == count  # window lengths on the host); idempotent
    loss, grads = _loss_and_grads(trainer, inputs)
    # One graph per module class (decoder attention, decoder MLP, vision MLP), not one per layer.
    assert counters["stats"]["unique_graphs"] == 3
    _assert_the_eager_loss_and_gradients(loss, grads, eager_loss, eager)
    assert any(".visual." in n for n in grads)
    # Without gradients (generation, reference log-probs) the modules run as written: no new graph, no call.
    _assert_no_call_without_gradients(trainer, inputs)
    modules = list(compiled.modules)
    compiled.detach()
    assert not compiled.modules and not any("forward" in vars(m) for m in modules)  # their class's forward again


@pytest.mark.trains
def test_whole_layers_give_the_eager_loss_and_every_gradient_with_one_graph_per_layer_class(
    tiny_dir, tmp_path, fresh_dynamo
):
    # unit="layers": each decoder layer is one compiled call (its norms and residual adds inside); the Qwen-VL vision
    # blocks keep their MLP compiled apart (their attention reads window lengths on the host).
    trainer, inputs, eager_loss, eager = _eager_baseline(tiny_dir, tmp_path, "qwen2_5_vl")
    compiled = CompiledLayers()
    count = compiled.attach(trainer.model, unit="layers")
    text_layers = trainer.model.config.get_text_config().num_hidden_layers
    assert count == text_layers + trainer.model.config.vision_config.depth
    assert compiled.attach(trainer.model, unit="layers") == count  # idempotent
    decoder = [m for m in compiled.modules if type(m).__name__.endswith("DecoderLayer")]
    assert len(decoder) == text_layers
    assert not any("forward" in vars(m) for layer in decoder for m in layer.children())  # the layer, not its parts
    loss, grads = _loss_and_grads(trainer, inputs)
    assert counters["stats"]["unique_graphs"] == 2  # the decoder layer, the vision MLP
    _assert_the_eager_loss_and_gradients(loss, grads, eager_loss, eager)
    _assert_no_call_without_gradients(trainer, inputs)  # without gradients, as written
    compiled.detach()
    assert not any(is_training_forward(vars(m).get("forward")) for m in trainer.model.modules())


def test_a_hybrid_model_keeps_its_layers_parts_under_unit_layers(tiny_dir, tmp_path, caplog):
    # Qwen3.5: the prompt-cache scorer passes every attention layer its cache in the training forward, and such calls
    # run as written, so whole layers would lose their MLP's compiled forward; the model keeps "modules", said once.
    trainer = _trainer(tiny_dir, tmp_path, "qwen3_5", lora="both", gc=True)
    compiled = CompiledLayers()
    with caplog.at_level("INFO", logger="vlm_grpo.engine.compiled_layers"):
        count = compiled.attach(trainer.model, unit="layers")
    assert count > 0 and "keeps 'modules'" in caplog.text
    assert not any(type(m).__name__ == "Qwen3_5DecoderLayer" for m in compiled.modules)
    assert all(is_training_forward(vars(layer.mlp).get("forward"))
               for layer in trainer.model.modules() if type(layer).__name__ == "Qwen3_5DecoderLayer")  # fmt: skip


@pytest.mark.trains
# Gemma3's run (~60 s on 2 cores) in the slow tier: llava_onevision's proves the same SigLIP and decoder paths.
@pytest.mark.parametrize("family", [pytest.param("gemma3", marks=pytest.mark.slow), "llava_onevision"])
def test_whole_siglip_and_decoder_layers_give_the_eager_gradients_and_hooked_layers_compile_by_parts(
    tiny_dir, tmp_path, fresh_dynamo, family, caplog
):
    # Gemma 3: its SigLIP vision layers and decoder layers compile whole. LLaVA-OneVision's vision tower is asked for a
    # hidden state below its last, so transformers hooks its SigLIP layers' attention to capture outputs (at the first
    # forward, the baseline's here): compiled whole, those hooks broke the graph at the ContextVar they read. Such a
    # layer compiles its attention and MLP apart, said once; the decoder layers stay whole. No graph breaks either way.
    trainer, inputs, eager_loss, eager = _eager_baseline(tiny_dir, tmp_path, family)
    compiled = CompiledLayers()
    compiled.attach(trainer.model, unit="layers")
    _SPLIT_SAID.clear()  # said once per layer class and process
    with caplog.at_level("INFO", logger="vlm_grpo.engine.compiled_layers"):
        loss, grads = _loss_and_grads(trainer, inputs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_the_eager_loss_and_gradients(loss, grads, eager_loss, eager)
    split = [m for m in compiled.modules if is_training_forward(vars(m.self_attn).get("forward"))]
    assert [type(m).__name__ for m in split] == (["SiglipEncoderLayer"] * 2 if family == "llava_onevision" else [])
    assert ("compiled apart" in caplog.text) == bool(split)
    assert counters["stats"]["unique_graphs"] == 2 + len({type(m) for m in split})  # two classes, one split in two
    compiled.detach()  # the split layers' parts too
    assert not any(is_training_forward(vars(m).get("forward")) for m in trainer.model.modules())


def test_the_training_compile_keeps_its_own_graphs_beside_the_decode_steps(fresh_dynamo):
    # The decode step compiles a decoder layer's class forward per batch size (limit raised to 64); the training forward
    # of the same class must not find those graphs counted against its own limit (8) and run uncompiled.
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.linear(x))

    block = Block()
    decode = torch.compile(Block.forward, backend="eager", dynamic=False)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
        for rows in range(1, 11):
            decode(block, torch.randn(rows, 4))
    assert counters["stats"]["unique_graphs"] == 10
    block.forward = _TrainingForward(block, "auto", whole=True)
    x = torch.randn(3, 4, requires_grad=True)
    block(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 11  # compiled, not over the limit
    assert x.grad is not None and block.linear.weight.grad is not None


def test_the_class_forward_is_read_at_each_call():
    # FSDP2 gives a sharded layer a subclass of its own (and transformers 5.24 a checkpointing wrapper that checkpoints
    # only as the outermost class forward): the compiled forward is the module's class's at the time of the call.
    layer = torch.nn.Linear(2, 2)
    forward = _TrainingForward(layer)
    assert forward.forward is torch.nn.Linear.forward

    class Sharded(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0

    layer.__class__ = Sharded
    assert forward.forward is Sharded.forward
    with torch.no_grad():
        assert forward(torch.ones(1, 2)).abs().sum() == 0


def test_an_unknown_unit_is_refused_in_one_line(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="compile_layers_unit must be one of 'modules', 'layers', got 'layer'"):
        VLMGRPOConfig(output_dir=str(tmp_path), compile_layers_unit="layer")
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    with pytest.raises(ValueError, match="compile_layers_unit must be one of"):
        CompiledLayers().attach(model, unit="block")


def test_unsupported_models_are_named(tiny_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    trainer = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", lora="both")
    assert unsupported_reason(trainer.model) is None
    layer = next(m for m in trainer.model.modules() if hasattr(m, COMPILED_CHILDREN[1]))
    layer.compile()
    assert "already compiled" in unsupported_reason(trainer.model)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    assert unsupported_reason(llama) is None  # a text model's decoder layers are checkpointable too
    assert "no transformers GradientCheckpointingLayer" in unsupported_reason(torch.nn.Linear(2, 2))
    # Reentrant checkpointing: the first forward runs without gradients (eager), the recomputation would be compiled.
    reentrant = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", lora="both", gc="reentrant")
    assert "reentrant" in unsupported_reason(reentrant.model)


def test_the_trainer_compiles_as_the_config_says(tiny_dir, tmp_path, caplog):
    # None (the default) is on for a model on a GPU only; True asks for it on the CPU too; torch_compile wins, said.
    assert not _trainer(tiny_dir, tmp_path, "qwen2_5_vl", lora="both").compiled_layers.modules
    asked = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", lora="both", compile_layers=True)
    assert len(asked.compiled_layers.modules) == 4  # the default unit: two decoder layers whole, two vision MLPs
    parts = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", lora="both", compile_layers=True, compile_layers_unit="modules")
    assert len(parts.compiled_layers.modules) == 6  # the decoder layers' attention and MLP apart
    with caplog.at_level("WARNING", logger="vlm_grpo.training.trainer"):
        whole = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", lora="both", compile_layers=True, torch_compile=True)
    assert not whole.compiled_layers.modules
    assert "torch_compile compiles the whole model" in caplog.text


def test_the_next_trainers_config_decides_and_other_forwards_are_left_alone(tiny_dir, tmp_path):
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4)

    def trainer(compile_layers):
        args = VLMGRPOConfig(output_dir=str(tmp_path / str(compile_layers)), per_device_train_batch_size=8,
                             num_generations=2, report_to="none", use_cpu=True, compile_layers=compile_layers,
                             compile_layers_unit="modules")  # fmt: skip
        return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=Dataset.from_list(_rows("qwen2_5_vl")),
                              processing_class=processor)  # fmt: skip

    modules = list(trainer(True).compiled_layers.modules)
    assert modules and all(isinstance(vars(m)["forward"], _TrainingForward) for m in modules)
    # A second trainer on the same model with compile_layers=False: the first one's compiled forwards are gone.
    assert not trainer(False).compiled_layers.modules and not any("forward" in vars(m) for m in modules)
    # A forward someone else put on a module (another library's patch) is neither replaced nor removed.
    patched = modules[0]
    patched.forward = own = lambda *args, **kwargs: None
    compiled = CompiledLayers()
    assert compiled.attach(model, unit="modules") == len(modules) - 1 and patched not in compiled.modules
    compiled.detach()
    assert vars(patched)["forward"] is own and detach_all(model) == 0


def test_linear_attention_layers_compile_with_convolution_and_scan_left_eager_and_no_graph_per_length(
    tiny_dir, fresh_dynamo
):
    # Qwen3.5's gated delta net (LoRA on its projections): outputs and gradients as eager at 2 to 5 chunks of 64
    # tokens, and no graph per length (the lengths of packed training rows change every step): the
    # scan's Python loop and the convolution's backward, which recompile per length when compiled, run eagerly.
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from vlm_grpo.engine.compiled_layers import LEFT_EAGER

    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen3_5", words=COLORS), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4, init_lora_weights=False)
    layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
    lora = [p for n, p in layer.named_parameters() if "lora_" in n]
    assert lora

    def run(length):
        torch.manual_seed(length)
        hidden = torch.randn(2, length, model.config.get_text_config().hidden_size, requires_grad=True)
        out = layer(hidden)
        (out * torch.randn_like(out)).sum().backward()
        grads = [hidden.grad.clone(), *(p.grad.clone() for p in lora)]
        for p in lora:
            p.grad = None
        return out.detach(), grads

    lengths = (70, 130, 200, 260)
    eager = {n: run(n) for n in lengths}
    compiled = CompiledLayers()
    compiled.attach(model)
    assert compiled.modules and layer not in compiled.modules  # not without asking
    assert compiled.attach(model, linear_attention=True) == len(compiled.modules)
    assert layer in compiled.modules
    graphs = []
    for n in lengths:
        out, grads = run(n)
        assert (out - eager[n][0]).abs().max() <= 1e-5 * eager[n][0].abs().max(), n
        for grad, reference in zip(grads, eager[n][1], strict=True):
            assert (grad - reference).norm() <= 1e-4 * reference.norm() + 1e-8, n
        graphs.append(counters["stats"]["unique_graphs"])
    # The default ("length"): the layer's own frame compiles once. The frames resumed after the scan's graph breaks take
    # sizes made inside the layer, which were not marked, so they compile as torch's default does (static first, the
    # length a symbol at the first new length): fewer graphs than "auto" (which doubles them), never again after.
    assert graphs[0] > 0 and graphs[1:] == [graphs[1]] * 3, graphs
    assert graphs[0] < graphs[1] < 2 * graphs[0], graphs
    assert all(getattr(getattr(modeling_qwen3_5, name), "_left_eager", False) for name in LEFT_EAGER)
    compiled.detach()
    assert "forward" not in vars(layer)


def test_linear_attentions_eager_wrappers_leave_the_key_a_new_process_computes(tiny_dir, monkeypatch):
    """The wrappers are patched into transformers' module at run time: hashed as wrappers, every other layer of the
    model had another key in a compile process (unpatched), which refused it (the trainer compiled it: the H200's
    Qwen3.5 fresh step 2 waited 6.8 s)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from vlm_grpo.engine import aot_keys
    from vlm_grpo.engine.compiled_layers import LEFT_EAGER

    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen3_5", words=COLORS), full_finetuning=False)
    compiled = CompiledLayers()
    compiled.attach(model, linear_attention=True)
    patched = aot_keys._module_globals.__wrapped__(modeling_qwen3_5.__name__)  # not the per-process cache
    for name in LEFT_EAGER:
        wrapper = getattr(modeling_qwen3_5, name)
        monkeypatch.setattr(modeling_qwen3_5, name, getattr(wrapper, aot_keys.LEFT_EAGER_MARK))  # as imported
    assert aot_keys._module_globals.__wrapped__(modeling_qwen3_5.__name__) == patched
    monkeypatch.setattr(modeling_qwen3_5, "l2norm", lambda x: x)  # any other patch still changes it
    assert aot_keys._module_globals.__wrapped__(modeling_qwen3_5.__name__) != patched
    compiled.detach()


def test_the_trainer_compiles_linear_attention_unless_told_not_to(tiny_dir, tmp_path):
    default = _trainer(tiny_dir, tmp_path, "qwen3_5", lora="both", compile_layers=True)
    eager = _trainer(tiny_dir, tmp_path, "qwen3_5", lora="both", compile_layers=True, compile_linear_attention=False)
    linear = [m for m in default.compiled_layers.modules if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    assert linear and not any(type(m).__name__ == "Qwen3_5GatedDeltaNet" for m in eager.compiled_layers.modules)
    assert len(default.compiled_layers.modules) == len(eager.compiled_layers.modules) + len(linear)


@pytest.mark.parametrize("shapes, expected", [("auto", [2, 4, 4]), ("length", [2, 2, 2]), ("all", [2, 2, 2])])
def test_new_sequence_lengths_compile_once_more_at_most(tiny_dir, fresh_dynamo, shapes, expected):
    # The training rows' length changes every step. torch's default ("auto") compiles a static graph, then at the first
    # new length one with the length as a symbol, which every later length runs; "length" compiles that graph from the
    # first call, "all" every size a symbol (one compile; on an H200 a slow one, see `SHAPE_MODES`). The loss and
    # every gradient are the eager ones at each length.
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4, init_lora_weights=False)
    model.train()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    vocab = model.config.get_text_config().vocab_size - 10

    def loss_and_grads(length):
        ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        for p in lora:
            p.grad = None
        loss = model(input_ids=ids).logits.float().square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in lora if p.grad is not None]  # the text model's

    lengths = (37, 90, 141)
    eager = {n: loss_and_grads(n) for n in lengths}
    assert len(eager[37][1]) > 20
    compiled = CompiledLayers()
    assert compiled.attach(model, shapes=shapes, unit="modules") > 0
    graphs = []
    for n in lengths:
        loss, grads = loss_and_grads(n)
        assert abs(loss - eager[n][0]) <= 1e-5 * abs(eager[n][0]), (n, loss, eager[n][0])
        for grad, reference in zip(grads, eager[n][1], strict=True):
            assert (grad - reference).norm() <= 1e-4 * reference.norm() + 1e-8, n
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == expected, graphs  # the decoder's attention and MLP: once each, or twice
    compiled.detach()


def test_the_trainer_passes_its_shape_setting_to_the_compiled_layers_and_refuses_others(tiny_dir, tmp_path):
    for setting in ("auto", "length"):
        trainer = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", lora="both", compile_layers=True,
                           compile_layers_dynamic=setting)  # fmt: skip
        forwards = [vars(m)["forward"] for m in trainer.compiled_layers.modules]
        assert forwards and all(f.shapes == setting for f in forwards)
    with pytest.raises(ValueError, match="compile_layers_dynamic must be one of 'auto', 'length', 'all', got True"):
        VLMGRPOConfig(output_dir=str(tmp_path), compile_layers_dynamic=True)
    trainer.compiled_layers.detach()
    with pytest.raises(ValueError, match="got 'static'"):  # the engine's own entry refuses it the same way
        CompiledLayers().attach(trainer.model, shapes="static")


@pytest.mark.trains
@pytest.mark.parametrize("shapes", ["auto", "length"])
def test_attention_given_a_cache_runs_as_written_not_one_graph_per_layer(tiny_dir, tmp_path, fresh_dynamo, shapes):
    # Qwen3.5's training forward continues each prompt's cache (`engine.prefix_cache`). An attention module reaches its
    # cache layer by `self.layer_idx`, on which Dynamo specialises: one graph per layer and cache class (6 here, 16 for
    # Qwen3.5-4B, past Dynamo's limit of 8), so those calls run as written and the MLPs stay compiled.
    trainer, inputs, eager_loss, eager = _eager_baseline(tiny_dir, tmp_path, "qwen3_5")
    compiled = CompiledLayers()
    assert compiled.attach(trainer.model, shapes=shapes) > 0
    calls = trainer.shared_prefix_calls
    graphs = []
    for _ in range(2):
        loss, grads = _loss_and_grads(trainer, inputs)
        graphs.append(counters["stats"]["unique_graphs"])
    assert trainer.shared_prefix_calls == calls + 2  # the prompt-cache path served both
    # The decoder's MLP ("auto": twice, the prompts' rows then the completions' rows, static then the sizes that
    # changed as symbols; "length": once, the length and the row count symbols from the first call) and the vision
    # tower's MLP; none for the attention layers, none more in the second step.
    assert graphs == ([3, 3] if shapes == "auto" else [2, 2]), graphs
    assert abs(loss - eager_loss) <= 1e-5 * abs(eager_loss) + 1e-7
    for name, grad in eager.items():
        assert (grads[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-8, name
    compiled.detach()


class _LinearAttentionLike(torch.nn.Module):
    """Takes its cache as transformers 5.17's Qwen3.5 linear attention does (`cache_params`), finding its layer in it
    by `layer_idx` (on which Dynamo would specialise: one graph per layer)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.proj = layer_idx, torch.nn.Linear(4, 4)

    def forward(self, hidden_states, cache_params=None):
        out = self.proj(hidden_states)
        if cache_params is not None:
            cache_params[self.layer_idx] = out.detach()
        return out


def test_a_call_given_its_cache_as_cache_params_runs_as_written():
    torch._dynamo.reset()
    layers = [_LinearAttentionLike(i) for i in range(3)]
    for layer in layers:
        layer.forward = _TrainingForward(layer)
    x = torch.randn(2, 5, 4, requires_grad=True)
    before = counters["stats"]["unique_graphs"]
    cache: dict = {}
    for layer in layers:  # the prompt-cache scorer's training forward: eager, no graph per layer
        layer(x, cache_params=cache).sum().backward()
    assert sorted(cache) == [0, 1, 2] and counters["stats"]["unique_graphs"] == before
    for layer in layers:  # without a cache: compiled, one graph for the class
        layer(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == before + 1
