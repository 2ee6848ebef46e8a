"""trainer.recompute_layers: the frozen LM's layers recomputed in the backward pass give the same
loss and gradients, keep fewer tensors for the backward, and leave the LM as it was."""

import torch

from ilcp.training.recompute import decoder_layers, recomputing


def loss_and_grad(lm, embeds, recompute: bool):
    x = embeds.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recomputing(lm.model, recompute):
        logits = lm.model(inputs_embeds=x, use_cache=False).logits
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    return float(loss.detach()), x.grad, sum(saved)


def test_recomputed_layers_give_the_same_gradients_from_fewer_saved_bytes(tiny_lm):
    torch.manual_seed(0)
    embeds = torch.randn(2, 12, tiny_lm.hidden_size)
    kept = loss_and_grad(tiny_lm, embeds, recompute=False)
    recomputed = loss_and_grad(tiny_lm, embeds, recompute=True)
    assert abs(kept[0] - recomputed[0]) < 1e-5
    assert torch.allclose(kept[1], recomputed[1], atol=1e-6)
    assert recomputed[2] < kept[2] / 2


def test_the_layers_are_restored_after_the_forward_and_after_an_error(tiny_lm):
    layers = list(decoder_layers(tiny_lm.model))
    assert len(layers) == tiny_lm.model.config.num_hidden_layers
    with recomputing(tiny_lm.model):
        assert all("forward" in layer.__dict__ for layer in layers)
    assert not any("forward" in layer.__dict__ for layer in layers)
    try:
        with recomputing(tiny_lm.model):
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert not any("forward" in layer.__dict__ for layer in layers)


def test_a_model_without_decoder_layers_is_refused_in_one_line():
    try:
        with recomputing(torch.nn.Linear(2, 2)):
            pass
    except ValueError as e:
        assert "no list of decoder layers" in str(e)
    else:
        raise AssertionError("a model without layers was wrapped")
