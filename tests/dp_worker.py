"""Run by tests/test_distributed.py as `torchrun --standalone --nproc_per_node 2 tests/dp_worker.py OUT`
(Gloo, CPU): each rank saves what the test compares to OUT/*.pt.

1. One `gradient_step` of ppo_cartpole_gpu.py on this rank's half of a fixed 64-row batch, with and
   without per-minibatch advantage normalisation (the weights, and the stats it returns); and docs/modifying.md's
   CleanRL update (`loss.backward()`, `average_gradients`) with ladder's Adam.
2. A few iterations of `train()` (16 envs per rank) of ppo_cartpole_gpu.py (eager and with --compile), vpg.py and
   reinforce.py: the weights every rank ends with.
3. ppo_mujoco_brax.py's observation statistics updated with this rank's half of a fixed batch.
4. `update` of ppo_atari_envpool.py and of ppo_mujoco_brax.py on this rank's half of a fixed batch (each where its
   extra is installed).
5. `train()` of ppo_cartpole_gpu.py with a second network trained besides the agent, with and without
   `average_gradients`: both networks' weights (the notes go to torchrun's stderr, which the test saves).
6. `train()` of ppo_cartpole_gpu.py with state each rank keeps its own of (given to `run.start` as `PerRank`, and,
   to see the note, as a plain tensor), straight through and stopped after iteration 2 then resumed: the weights.
7. The recurrent recipe's copy of ppo_cartpole_gpu.py (a GRU policy, its hidden state `PerRank`), straight through
   and stopped after iteration 2 then resumed: the weights.
8. The copy with the three recipes of tests/recipes.py (observation normalisation, RND, a Polyak target critic), each
   rank's statistics its own, straight through and stopped after iteration 2 then resumed: the agent's whole state.
"""

import functools
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_atari_envpool as A  # noqa: E402
import ppo_cartpole_gpu as P  # noqa: E402
import ppo_mujoco_brax as B  # noqa: E402  (torch only: JAX is imported when a Brax env is built)
import reinforce as R  # noqa: E402
import vpg as V  # noqa: E402
from conftest import missing_extras  # noqa: E402
from ladder.distributed import average_gradients  # noqa: E402
from ladder.optim import Adam  # noqa: E402
from ladder.run import PerRank  # noqa: E402
from recipes import ALL_THREE, recipe_copy, recurrent_copy  # noqa: E402


def fixed_batch(n: int = 64) -> P.Batch:
    g = torch.Generator().manual_seed(1)
    return P.Batch(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g),
                   torch.randn(n, generator=g) - 0.7, torch.randn(n, generator=g), torch.randn(n, generator=g),
                   torch.randn(n, generator=g))  # fmt: skip


def update_batches() -> dict:
    """Fixed 32-row batches for Atari's and Brax's `update` (random numbers: the shapes and dtypes matter)."""
    g = torch.Generator().manual_seed(3)
    rest = lambda: [torch.randn(32, generator=g) - (1.5 if i == 0 else 0) for i in range(4)]  # noqa: E731
    atari_obs = torch.randint(0, 256, (32, 4, 84, 84), generator=g, dtype=torch.uint8)
    return {"atari": A.Batch(atari_obs, torch.randint(0, 4, (32,), generator=g), *rest(), torch.ones(32)),
            "brax": B.Batch(torch.randn(32, 3, generator=g), torch.randn(32, 2, generator=g), *rest())}  # fmt: skip


class SGD(Adam):
    """Plain SGD on ladder's flat parameters (its step written out, as Adam's): each weight moves by lr times its
    gradient."""

    def step(self, closure=None) -> None:
        for group, p, g in zip(self.param_groups, self.flat.split(self.sizes), self.flat_grad().split(self.sizes)):
            p.sub_(group["lr"] * g)


def updated(name: str, batch) -> dict:
    """The weights after `update` (2 epochs, 1 minibatch, no advantage normalisation) on `batch`, by plain SGD and no
    clipping (the gradient norms are 11.4 and 0.70): each weight moves by lr times its gradient, so a wrong scale (the
    ranks' sum for their mean) shows, and another order of float32 sums moves it by lr times that rounding (2 ranks
    against 1 process: 3e-8 at most, moves of 4e-4 to 9e-3 for Atari). Adam's first step, lr * g / (|g| + eps), hides
    the scale and multiplies the rounding by up to lr / eps = 100 where |g| << eps: 1.9e-5 apart on an Intel Xeon."""
    torch.manual_seed(0)
    agent = A.Agent(4) if name == "atari" else B.Agent(3, 2)
    optimizer = SGD(agent, lr=0.01)
    flags = dict(norm_adv=False, num_minibatches=1, update_epochs=2, max_grad_norm=1e3)
    module = A if name == "atari" else B  # both take the eager gradient step of CartPole's PPO
    args = module.Args(**flags)
    step = functools.partial(module.gradient_step, agent, optimizer, module.ppo_loss, args)
    module.update(functools.partial(module.one_epoch, step), batch, args)
    return agent.state_dict()


def with_a_second_network(args, average: bool) -> dict:
    """`P.train(args)` with a network trained besides the agent, as in RND (Burda et al. 2018): a predictor fitted after
    each iteration to a fixed random target on the rollout's observations, both given to `run.start` and built after
    the seed (`--seed + rank`: they start different on each rank); with `average`, the predictor's gradients go
    through `average_gradients`. Returns both networks' final weights."""
    real_start, real_film, nets = P.Run.start, P.Run.film, {}

    def start(self, *a, **k):
        nets["target"], nets["predictor"] = P.mlp(4, 8, out_std=1.0), P.mlp(4, 8, out_std=1.0)
        nets["optimizer"] = torch.optim.Adam(nets["predictor"].parameters(), lr=1e-2)
        return real_start(self, *a, **k, target=nets["target"], predictor=nets["predictor"])

    def film(self, rollout=None):  # (called after run.log in every iteration, with the rollout)
        obs = rollout.obs.flatten(0, 1)
        loss = (nets["predictor"](obs) - nets["target"](obs).detach()).square().mean()
        nets["optimizer"].zero_grad()
        loss.backward()
        if average:
            average_gradients(nets["predictor"])
        nets["optimizer"].step()
        return real_film(self, rollout)

    P.Run.start, P.Run.film = start, film
    try:
        P.train(args)
    finally:
        P.Run.start, P.Run.film = real_start, real_film
    return {name: nets[name].state_dict() for name in ("target", "predictor")}


def stopped_and_resumed(module, args, stop_at: int):
    """`module.train(args)`, with `stop_at` stopped after that iteration (a signal on every rank), then resumed."""
    real_log = module.Run.log

    def log(self, *a):
        if stop_at and self.progress.iteration == stop_at - 1 and not self.args.resume:
            self.signals.received = 15  # as torchrun's SIGTERM to every rank
        return real_log(self, *a)

    module.Run.log = log
    try:
        if stop_at:
            try:
                module.train(args)
            except KeyboardInterrupt:
                pass
            folder = os.path.join("runs", next(d for d in sorted(os.listdir("runs")) if f"__{args.exp_name}__" in d))
            args = replace(args, resume=folder)
        return module.train(args)
    finally:
        module.Run.log = real_log


def with_state_per_rank(args, per_rank: bool, stop_at: int = 0):
    """`P.train(args)` with a running mean of this rank's own observations (as a recurrent policy's hidden state is
    this rank's own) that the loss reads, given to `run.start` as `PerRank` (else as a plain tensor); with `stop_at`,
    stopped after that iteration (a signal on every rank), then resumed. Returns the agent."""
    real_start, real_film, real_loss, box = P.Run.start, P.Run.film, P.ppo_loss, {}

    def start(self, *a, **k):
        box["mean"] = torch.zeros(4)
        return real_start(self, *a, **k, obs_mean=PerRank(box["mean"]) if per_rank else box["mean"])

    def film(self, rollout=None):  # (called after run.log in every iteration, with the rollout)
        box["mean"].mul_(0.5).add_(rollout.obs.mean((0, 1)), alpha=0.5)  # differs by rank: their envs differ
        return real_film(self, rollout)

    def loss(agent, args, batch):
        value, stats = real_loss(agent, args, batch)
        return value + 1e-2 * (agent.critic(box["mean"]).square().mean()), stats

    P.Run.start, P.Run.film, P.ppo_loss = start, film, loss
    try:
        return stopped_and_resumed(P, args, stop_at)
    finally:
        P.Run.start, P.Run.film, P.ppo_loss = real_start, real_film, real_loss


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for norm_adv in (False, True):
        torch.manual_seed(0)
        agent = P.Agent(4, 2)
        optimizer = Adam(agent, lr=1e-2, eps=1e-5)
        half = P.Batch(*(x[32 * rank : 32 * (rank + 1)] for x in fixed_batch()))
        stats = P.gradient_step(agent, optimizer, P.ppo_loss, P.Args(norm_adv=norm_adv, max_grad_norm=0.05), half)
        torch.save(agent.state_dict(), os.path.join(out, f"step_norm{int(norm_adv)}_rank{rank}.pt"))
        torch.save(stats, os.path.join(out, f"stats_norm{int(norm_adv)}_rank{rank}.pt"))
    torch.manual_seed(0)
    agent = P.Agent(4, 2)
    optimizer = Adam(agent, lr=1e-2, eps=1e-5)
    loss, _ = P.ppo_loss(agent, P.Args(norm_adv=False), half)  # (the loop's half batch)
    optimizer.zero_grad()
    loss.backward()
    average_gradients(agent)
    torch.nn.utils.clip_grad_norm_(agent.parameters(), 0.05)
    optimizer.step()
    torch.save(agent.state_dict(), os.path.join(out, f"step_cleanrl_rank{rank}.pt"))
    rms = B.RunningMeanStd((3,))
    rms.update(torch.randn(40, 3, generator=torch.Generator().manual_seed(2))[20 * rank : 20 * (rank + 1)] * 2 + 1)
    torch.save(rms.state_dict(), os.path.join(out, f"rms_rank{rank}.pt"))
    for name, batch in update_batches().items():
        if name in missing_extras():  # a CartPole-only install: the test skips it, naming the pip line
            continue
        half = type(batch)(*(x[16 * rank : 16 * (rank + 1)] for x in batch))
        torch.save(updated(name, half), os.path.join(out, f"update_{name}_rank{rank}.pt"))
    os.chdir(out)
    args = P.Args(num_envs=16, num_steps=8, num_minibatches=2, total_timesteps=2 * 16 * 8 * 5, target_return=None,
                  eval_episodes=0, progress_bar=False, device="cpu")  # fmt: skip
    agent = P.train(args)
    torch.save(agent.state_dict(), os.path.join(out, f"train_rank{rank}.pt"))
    compiled = P.train(replace(args, compile=True, exp_name="compiled"))  # the compiled loss, all-reduced gradients
    torch.save(compiled.state_dict(), os.path.join(out, f"train_compiled_rank{rank}.pt"))
    for average in (False, True):
        nets = with_a_second_network(replace(args, exp_name=f"second_averaged{int(average)}"), average)
        torch.save(nets, os.path.join(out, f"second_averaged{int(average)}_rank{rank}.pt"))
    for per_rank, stop_at in ((True, 0), (True, 2), (False, 2)):
        name = f"per_rank{int(per_rank)}_stopped{stop_at}"
        agent = with_state_per_rank(replace(args, exp_name=name, checkpoint_interval=1), per_rank, stop_at)
        torch.save(agent.state_dict(), os.path.join(out, f"{name}_rank{rank}.pt"))
    os.makedirs(f"rank{rank}")
    recurrent = recurrent_copy(P.__file__, f"rank{rank}")  # on PositionsCart-v1, its default
    for stop_at in (0, 2):
        gru_args = recurrent.Args(**(vars(args) | {"env_id": "PositionsCart-v1", "exp_name": f"gru_stopped{stop_at}"}))
        agent = stopped_and_resumed(recurrent, gru_args, stop_at)
        torch.save(agent.state_dict(), os.path.join(out, f"gru_stopped{stop_at}_rank{rank}.pt"))
    recipes = recipe_copy(P.__file__, f"rank{rank}", ALL_THREE, "recipes")
    for stop_at in (0, 2):
        agent = stopped_and_resumed(recipes, recipes.Args(**(vars(args) | {"exp_name": f"recipes{stop_at}"})), stop_at)
        torch.save(agent.state_dict(), os.path.join(out, f"recipes_stopped{stop_at}_rank{rank}.pt"))
    for module, steps in ((V, 8), (R, 500)):  # VPG and REINFORCE run data parallel too
        args = module.Args(num_envs=16, num_steps=steps, total_timesteps=2 * 16 * 8 * 5, target_return=None,
                           eval_episodes=0, progress_bar=False, device="cpu")  # fmt: skip
        torch.save(module.train(args).state_dict(), os.path.join(out, f"train_{module.__name__}_rank{rank}.pt"))
    dist.barrier()  # nobody leaves the group while another rank may still be in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
