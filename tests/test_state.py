"""TorchState's host-memory commits, in one process: restore returns exactly the committed
values, also after a second failure before the next commit (no aliasing of saved buffers)."""
import torch

from hvd_edl.torch.elastic import ElasticSampler, TorchState


def _train_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    optimizer.step()


def _snapshot(model, optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    momenta = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return params, momenta


def _equal(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_restore_twice_returns_the_commit_and_buffers_are_reused():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(range(100), batch_size=4)
    _train_step(model, optimizer)
    state = TorchState(model, optimizer, sampler=sampler, epoch=3)
    committed = _snapshot(model, optimizer)
    buffers = [t.data_ptr() for t in state._saved_model.values()]
    for _ in range(2):  # fail, restore, train on, fail again before any commit
        _train_step(model, optimizer)
        sampler.record_batch(0, 4)
        state.epoch = 7
        assert not _equal(_snapshot(model, optimizer), committed)
        state.restore()
        assert _equal(_snapshot(model, optimizer), committed)
        assert state.epoch == 3 and sampler.consumed == 0
    _train_step(model, optimizer)
    state.save()
    assert [t.data_ptr() for t in state._saved_model.values()] == buffers  # reused in place
    assert _equal(_snapshot(model, optimizer), _snapshot(model, optimizer))
