"""A reinforcement-learning loop as people write one (pytorch/examples' reinforce.py): no data,
each step's episodes rolled out by the policy itself. Ported: the step's episodes are a batch
function's rows (`lambda: torch.arange(EPISODES)`: each rank rolls out its share of them, its
states and actions drawn from torch, which job.prepare puts on a stream of its own), every rank
agrees on when to stop through job.reduce in the loop, and the running reward the stop reads is a
dict of the script's own that job.track keeps in checkpoints.

The task is a two-armed contextual bandit: an episode is 8 draws of a 4-number state, the right
arm the one whose first two numbers sum higher, reward 1 for it. Rank 0 prints the running reward
at every step and, at the end, the step it passed --target at.

    invoke train --script tests/scripts/rollouts.py --checkpoint-every 5 -- [--fail-once FILE]
"""

import argparse
from pathlib import Path

import torch
import torch.nn as nn

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=7)
parser.add_argument("--target", type=float, default=0.9)
parser.add_argument("--max-steps", type=int, default=200)
parser.add_argument("--fail-once", type=Path, help="rank 0 raises at step 12 unless this file exists, which it writes")
args = parser.parse_args()

EPISODES, LENGTH = 4, 8
job = hh.init()
torch.manual_seed(args.seed)  # as on one device: job.prepare gives each rank its own episodes

policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
optimizer = torch.optim.Adam(policy.parameters(), lr=0.05)
stats = {"running": 0.5}  # the running reward, as the script keeps it
job.track("stats", stats)
policy, optimizer, my_episodes = job.prepare(policy, optimizer, lambda: torch.arange(EPISODES))

while job.step < args.max_steps:
    mine = len(my_episodes())  # this rank's episodes of the step
    states = torch.randn(mine, LENGTH, 4)
    dist = torch.distributions.Categorical(logits=policy(states))
    actions = dist.sample()
    rewards = (actions == (states[..., 0] + states[..., 1] < 0).long()).float()  # arm 1 where they sum below 0
    loss = -(dist.log_prob(actions) * (rewards - rewards.mean())).sum(1).mean()
    job.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    total = job.reduce({"reward": rewards.sum().item(), "n": rewards.numel()})  # every rank the same numbers
    stats["running"] = 0.8 * stats["running"] + 0.2 * total["reward"] / total["n"]
    if job.is_main:
        print(f"step {job.step}: running reward {stats['running']:.6f}", flush=True)
    if args.fail_once and job.step == 12 and job.is_main and not args.fail_once.exists():
        args.fail_once.touch()
        raise RuntimeError(f"crashed at step {job.step}")  # a crash to resume from
    if stats["running"] > args.target:
        break  # on every rank alike: they read the same reduced numbers
if job.is_main:
    print(f"solved at step {job.step}" if stats["running"] > args.target else f"not solved in {job.step} steps")
