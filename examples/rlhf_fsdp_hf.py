"""GRPO with real building blocks on CPU: an FSDP2 trainer gang and a Hugging Face sampler gang.

    loader (1 worker) -> sampler group (dp=2, HF ``model.generate``) -> reward group (1 worker)
        -> trainer group (2 workers, the same HF model under torch FSDP2, gloo)
        -> weight sync from the sharded parameters -> next step

The model is a tiny Llama (``LlamaForCausalLM`` from a ``LlamaConfig``, random
init, nothing downloaded) with a character-level tokenizer built here with the
``tokenizers`` library (digits, ``=``, and the special tokens). The task has a
checkable reward: a prompt is ``--digits`` random digits and ``=``, the answer
must be every digit plus one (mod 10), e.g. ``3914=`` -> ``4025``; the reward
is the fraction of answer characters that are right. A random policy scores
about 0.07; the default run (120 steps) ends near 0.9 (see README).

- Trainer: the gang's 2 workers build the same model (seeded alike), take the
  FSDP2/HSDP mesh from ``twinkle_ray.mesh_factory.create_fsdp2_mesh`` and its
  torch twin ``DeviceMesh.to_torch()``, and ``fully_shard`` every decoder
  layer and the root on its ``dp_shard_cp`` dim (``(dp_replicate,
  dp_shard_cp)`` for HSDP): torch makes the process groups, nothing is
  sharded by hand. One GRPO step per batch: ``--ppo-epochs`` clipped updates
  against the sampler's log-probs, with an entropy bonus.
- Sampler: each worker runs ``model.generate`` (pure sampling: temperature 1,
  no top-k/top-p) on its data-rank slice of the batch (``dispatch='slice_dp'``)
  and returns the tokens with their log-probs (from the raw logits, i.e. the
  distribution it sampled from).
- Weight sync (``twinkle_ray.weights.sync_weights``): the trainer's parameters
  are DTensor shards; every trainer rank calls ``full_tensor()`` once per sync,
  rank 0 keeps the full tensors and broadcasts them in buckets to both sampler
  workers over a separate gloo group. The names are the HF names (what vLLM's
  ``load_weights`` takes). The sampler's log-probs then match the trainer's:
  the first update's ratio is 1 up to float rounding (printed as ``|r-1|``).
- At the end: the reward curve (text, and a PNG via matplotlib) and an HF
  checkpoint (``save_pretrained`` of the gathered full weights on trainer
  rank 0, plus the tokenizer), loaded back with ``from_pretrained`` and scored
  greedily on fresh prompts.

Data never passes through the driver: batches stay in the loader's worker
until the samplers pull their halves; rollouts go from the samplers straight
to the reward worker and the trainers. The driver reads each step's metrics.

    python examples/rlhf_fsdp_hf.py                # 120 steps, embedded Ray
    python examples/rlhf_fsdp_hf.py --quick        # 30 steps (under 2 minutes on 2 cores)
    python examples/rlhf_fsdp_hf.py --checkpoint-dir /tmp/fsdp            # a checkpoint every 5 steps
    python examples/rlhf_fsdp_hf.py --checkpoint-dir /tmp/fsdp --resume   # after the driver died
    ray job submit --working-dir . -- python examples/rlhf_fsdp_hf.py --quick   # on a cluster

The last line is ``RESULT {json}`` (steps, resumed_from, rewards of every step
of the run, timings, sync figures, HF checkpoint). ``--checkpoint-dir DIR``
saves ``DIR/step-NNNNNN/`` atomically every ``--checkpoint-every`` steps: each
trainer rank's FSDP2 shards and optimizer state (local tensors, loaded back in
place), its policy version, each sampler rank's RNG, the loader's position and
the driver's RNGs (examples/checkpointing.py); ``--resume`` continues after
the newest complete one.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import tempfile
import time

import checkpointing  # examples/ is on sys.path
import numpy as np
import torch
from reward_report import reward_curve, save_plot

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.data import DataLoader
from twinkle_ray.mesh_factory import create_fsdp2_mesh
from twinkle_ray.weights import WeightSyncMixin, sync_weights

RANDOM_POLICY_REWARD = 0.07  # mean reward of a random policy on this task
DIGITS = "0123456789"
SPECIAL = {"eq": "=", "bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>"}
VOCAB = [*DIGITS, *SPECIAL.values()]  # token id of digit d is d
MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4)


# ------------------------------------------------------------------------------ tokenizer, model, task
def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over :data:`VOCAB` (built here, nothing downloaded)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    bos = SPECIAL["bos"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=SPECIAL["eos"],
                                   pad_token=SPECIAL["pad"], unk_token=SPECIAL["unk"])


def model_config(digits: int):
    """The tiny Llama's config: vocabulary and special ids from the tokenizer's vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(VOCAB), max_position_embeddings=2 * digits + 8, tie_word_embeddings=False,
                       bos_token_id=VOCAB.index(SPECIAL["bos"]), eos_token_id=VOCAB.index(SPECIAL["eos"]),
                       pad_token_id=VOCAB.index(SPECIAL["pad"]), **MODEL)


def build_model(digits: int, seed: int):
    """A randomly initialised ``LlamaForCausalLM`` (float32); the same ``seed`` gives the same weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config(digits)).float()


def expected(prompt: str) -> str:
    """The right answer for a prompt like ``'3914='``: every digit plus one, mod 10."""
    return "".join(DIGITS[(int(c) + 1) % 10] for c in prompt.rstrip("="))


def score_text(prompt: str, answer: str) -> float:
    """Fraction of the answer's characters that are right (the reward)."""
    want = expected(prompt)
    return sum(a == b for a, b in zip(answer, want, strict=False)) / len(want)  # a short answer scores less


def answer_texts(tokenizer, answer_ids) -> list[str]:
    """Decode answers one character per token (a special token reads as '?', so positions stay aligned)."""
    rows = answer_ids.tolist()
    return ["".join(t if len(t) == 1 else "?" for t in tokenizer.convert_ids_to_tokens(r)) for r in rows]


def make_prompts(n: int, digits: int, seed: int) -> list[str]:
    """The prompt set (built inside the loader's worker)."""
    rows = np.random.default_rng(seed).integers(0, 10, (n, digits))
    return ["".join(map(str, r)) + "=" for r in rows]


def digest(tensors: dict) -> dict[str, str]:
    """name -> sha256 of the tensor's raw bytes (and dtype, shape)."""
    out = {}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[name] = h.hexdigest()
    return out


# ------------------------------------------------------------------------------ the gangs
@remote_class()
class Sampler(WeightSyncMixin):
    """HF ``model.generate`` on this worker's data-rank slice; weights come from the trainer."""

    def __init__(self, device_mesh: DeviceMesh, digits: int, group_size: int, seed: int):
        from transformers import GenerationConfig

        self.tokenizer = build_tokenizer()
        self.model = build_model(digits, seed + 1).eval()  # overwritten by the first weight sync
        self.group_size = group_size
        self.digits = digits
        self.gen_config = GenerationConfig(
            do_sample=True, max_new_tokens=digits, temperature=1.0, top_k=0, top_p=1.0,
            eos_token_id=None, pad_token_id=self.tokenizer.pad_token_id,
            bos_token_id=self.tokenizer.bos_token_id, output_logits=True, return_dict_in_generate=True)
        torch.manual_seed(seed * 1000 + twinkle.get_rank())  # a different sampling stream per worker

    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, prompts: list) -> dict:
        enc = self.tokenizer(list(prompts), return_tensors="pt")
        ids = enc["input_ids"].repeat_interleave(self.group_size, dim=0)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self.gen_config)
        answers = out.sequences[:, ids.shape[1]:]
        if answers.shape[1] != self.digits:
            raise RuntimeError(f"generate returned {answers.shape[1]} tokens, expected {self.digits}")
        logp = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(-1, answers[..., None])[..., 0]
        texts = answer_texts(self.tokenizer, answers)
        return {"prompt": [p for p in prompts for _ in range(self.group_size)], "text": texts,
                "prompt_ids": ids.numpy(), "answer_ids": answers.numpy(), "logp": logp.numpy()}

    # A checkpoint keeps the sampling stream (HF generate draws from torch's global RNG); the
    # weights come back with the next sync.
    def state_dict(self) -> dict:
        return {"torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch_rng"])

    @remote_function(dispatch="all", collect="first")
    def load_rank_state(self, path: str) -> None:
        """Load this rank's file of a ``save_state(path)`` (resuming from a checkpoint)."""
        load_rank_file(self, path)

    @remote_function(dispatch="all", collect="flatten")
    def weight_digest(self) -> list[dict]:
        """[{name: sha256}] of this worker's weights."""
        return [digest(self.weight_sync_tensors())]


@remote_class()
class Reward:
    """Scores the decoded answers; GRPO advantages are rewards normalised within each prompt's group."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    @remote_function(collect="flatten")
    def score(self, rollouts: dict) -> dict:
        reward = np.array([score_text(p, a) for p, a in zip(rollouts["prompt"], rollouts["text"], strict=True)],
                          dtype=np.float32)
        groups = reward.reshape(-1, self.group_size)
        adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
        return {"reward": reward, "advantage": adv.reshape(-1).astype(np.float32)}


def shard_mesh(torch_mesh, mesh: DeviceMesh):
    """The torch mesh FSDP2 shards on: ``dp_shard_cp``, with ``dp_replicate`` first for HSDP.

    Without context parallelism ``dp_shard_cp`` is ``dp_shard`` itself: the root
    dim is taken then (torch warns that slicing a flattened dim from the root
    mesh will be deprecated).
    """
    shard = "dp_shard" if mesh.get_dim_size("cp") == 1 else "dp_shard_cp"
    if mesh.get_dim_size("dp_replicate") > 1:
        return torch_mesh["dp_replicate", shard]
    return torch_mesh[shard]


@remote_class()
class Trainer(WeightSyncMixin):
    """The HF model under FSDP2 over the gang (gloo); one GRPO step per batch."""

    def __init__(self, device_mesh: DeviceMesh, digits: int, seed: int, lr: float, ppo_epochs: int,
                 entropy_coef: float, clip: float = 0.2):
        from torch.distributed.fsdp import fully_shard

        self.mesh = device_mesh
        self.digits = digits
        self.model = build_model(digits, seed)  # every rank builds the same weights, then keeps its shard
        self.torch_mesh = device_mesh.to_torch()
        self.fsdp_mesh = shard_mesh(self.torch_mesh, device_mesh)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=self.fsdp_mesh)
        fully_shard(self.model, mesh=self.fsdp_mesh)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.ppo_epochs = ppo_epochs
        self.entropy_coef = entropy_coef
        self.clip = clip
        self.version = 0  # policy updates applied (one per train_step); saved in checkpoints

    @remote_function(dispatch="slice_dp", collect="mean")
    def train_step(self, rollouts: dict, scores: dict) -> dict:
        prompt_ids = torch.as_tensor(np.array(rollouts["prompt_ids"]))
        answers = torch.as_tensor(np.array(rollouts["answer_ids"]))
        old_logp = torch.as_tensor(np.array(rollouts["logp"]))
        adv = torch.as_tensor(np.array(scores["advantage"]))[:, None]
        seq = torch.cat([prompt_ids, answers], dim=1)
        start = prompt_ids.shape[1] - 1  # logits at position i predict token i + 1
        self.model.train()
        stats: dict[str, float] = {}
        for epoch in range(self.ppo_epochs):
            logits = self.model(input_ids=seq).logits[:, start:-1].float()
            lp_all = logits.log_softmax(-1)
            logp = lp_all.gather(-1, answers[..., None])[..., 0]
            ratio = torch.exp(logp - old_logp)
            surrogate = torch.min(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
            entropy = -(lp_all.exp() * lp_all).sum(-1).mean()
            loss = -surrogate.mean() - self.entropy_coef * entropy
            self.opt.zero_grad()
            loss.backward()  # FSDP2 reduce-scatters the gradients over the mesh here
            self.opt.step()
            if epoch == 0:  # the sampler's log-probs against the synced trainer's: ratio 1
                stats = {"loss": loss.item(), "entropy": entropy.item(),
                         "ratio_err": (ratio.detach() - 1).abs().max().item()}
        stats["reward"] = float(np.mean(scores["reward"]))
        self.version += 1
        stats["version"] = float(self.version)
        return stats

    # -- checkpoint: each rank saves its own shards (local tensors) and loads them back in place --
    def state_dict(self) -> dict:
        local = {k: _local(v).detach().clone() for k, v in self.model.state_dict().items()}
        opt = self.opt.state_dict()
        opt["state"] = {i: {k: _local(v).detach().clone() for k, v in st.items()} for i, st in opt["state"].items()}
        return {"model": local, "opt": opt, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                _local(v).copy_(state["model"][k])
        params = [p for g in self.opt.param_groups for p in g["params"]]
        opt = dict(state["opt"])
        opt["state"] = {}
        for i, st in state["opt"]["state"].items():
            p = params[int(i)]
            opt["state"][i] = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
                if isinstance(p, DTensor) and k != "step" and v.shape == p.to_local().shape else v
                for k, v in st.items()}
        self.opt.load_state_dict(opt)
        self.version = int(state["version"])

    @remote_function(dispatch="all", collect="first")
    def load_rank_state(self, path: str) -> None:
        """Load this rank's file of a ``save_state(path)`` (resuming from a checkpoint)."""
        load_rank_file(self, path)

    # -- inspection and checkpoint --------------------------------------------------------------
    @remote_function(dispatch="all", collect="flatten")
    def mesh_report(self) -> list[dict]:
        """What torch built vs what twinkle's DeviceMesh says, on this rank."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        rank = dist.get_rank()
        tm = self.torch_mesh
        names = [*self.mesh.mesh_dim_names, *self.mesh.flattened]
        torch_groups = {n: dist.get_process_group_ranks(tm[n].get_group()) for n in names}
        twinkle_groups = {n: self.mesh.get_group_ranks(n, rank) for n in names}
        params = [p for p in self.model.parameters()]
        fsdp = {
            "all_dtensor": all(isinstance(p, DTensor) for p in params),
            "dim_names": list(params[0].device_mesh.mesh_dim_names),
            "mesh_ranks": params[0].device_mesh.mesh.flatten().tolist(),
            "group_ranks": [dist.get_process_group_ranks(params[0].device_mesh.get_group(i))
                            for i in range(params[0].device_mesh.ndim)],
            "same_mesh": all(p.device_mesh == self.fsdp_mesh for p in params),
            "placements": sorted({str(p.placements) for p in params}),
            "local_numel": sum(p.to_local().numel() for p in params),
            "full_numel": sum(p.numel() for p in params),
        }
        return [{"rank": rank, "torch": torch_groups, "twinkle": twinkle_groups, "fsdp": fsdp,
                 "data_rank": self.mesh.data_rank}]

    @remote_function(dispatch="all", collect="flatten")
    def full_digest(self) -> list[dict]:
        """Rank 0: [{name: sha256}] of the full (gathered) weights; other ranks: []."""
        tensors = self.weight_sync_tensors()  # a collective: every rank gathers
        return [digest(tensors)] if twinkle.get_rank() == 0 else []

    @remote_function(dispatch="all", collect="flatten")
    def save_pretrained(self, path: str) -> list[str]:
        """Gather the full weights (every rank) and write an HF checkpoint + tokenizer on rank 0."""
        tensors = self.weight_sync_tensors()
        if twinkle.get_rank() != 0:
            return []
        from transformers import LlamaForCausalLM

        plain = LlamaForCausalLM(model_config(self.digits))
        plain.load_state_dict(tensors, strict=True)
        plain.save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        return [path]


def _local(t):
    """A DTensor's local shard (other tensors as they are)."""
    return t.to_local() if hasattr(t, "to_local") else t


def load_rank_file(instance, path: str) -> None:
    """``instance.load_state_dict`` of this rank's ``rank<r>.pt`` under ``path`` (what save_state(path) wrote)."""
    instance.load_state_dict(torch.load(os.path.join(path, f"rank{twinkle.get_rank()}.pt"), weights_only=False))


# ------------------------------------------------------------------------------ the driver
def groups() -> list[DeviceGroup]:
    return [
        DeviceGroup("data", 1, "cpu"),
        DeviceGroup("sampler", 2, "cpu"),
        DeviceGroup("reward", 1, "cpu"),
        DeviceGroup("trainer", 2, "cpu"),
    ]


def endless(loader):
    """Batches across epochs (each epoch reshuffled by the loader)."""
    while True:
        yield from loader


def build(*, digits: int = 4, group_size: int = 8, batch_size: int = 16, lr: float = 2e-3, ppo_epochs: int = 4,
          entropy_coef: float = 0.1, seed: int = 0, num_prompts: int = 4096) -> dict:
    """Create the loader and the three gangs (needs ``twinkle.initialize`` with :func:`groups`)."""
    sampler_mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    trainer_mesh = create_fsdp2_mesh(world_size=2, device_type="cpu")  # (pp, dp_replicate, dp_shard, cp, tp)
    with twinkle.start_together():  # the four gangs start up at the same time
        loader = DataLoader(functools.partial(make_prompts, num_prompts, digits, seed), batch_size=batch_size,
                            device_mesh=sampler_mesh, shuffle=True, seed=seed, remote_group="data")
        return {
            "loader": loader,
            "sampler": Sampler(sampler_mesh, digits, group_size, seed, remote_group="sampler"),
            "reward": Reward(group_size, remote_group="reward"),
            "trainer": Trainer(trainer_mesh, digits, seed, lr, ppo_epochs, entropy_coef, remote_group="trainer"),
        }


def timed_sync(trainer, sampler) -> dict:
    """One weight sync; the sender's figures plus the driver's wall time (gather included)."""
    t0 = time.perf_counter()
    stats = sync_weights(trainer, sampler)
    wall = time.perf_counter() - t0
    return {"mb": stats.bytes / 1e6, "seconds": stats.seconds, "gb_per_s": stats.gb_per_s, "wall_s": wall,
            "tensors": stats.tensors, "buckets": stats.buckets, "backend": stats.backend}


def train(gangs: dict, steps: int, log=print, *, checkpoint_dir: str | None = None, checkpoint_every: int = 5,
          resume: bool = False) -> dict:
    """``steps`` GRPO steps; returns the per-step metrics and sync figures.

    With ``checkpoint_dir``, a checkpoint every ``checkpoint_every`` steps and
    after the last (see examples/checkpointing.py); with ``resume``, the run
    continues after the newest complete one (``history`` then holds every step).
    """
    sampler, reward, trainer = gangs["sampler"], gangs["reward"], gangs["trainer"]
    ckpt, latest = checkpointing.open_checkpoints(checkpoint_dir, resume)
    saved_gangs = {"trainer": trainer, "sampler": sampler}
    history, first_step, saves = [], 1, []
    if latest is not None:
        state = checkpointing.restore(latest, loader=gangs["loader"], gangs=saved_gangs)
        history, first_step = list(state["history"]), latest.step + 1
        log(f"resumed from {latest.path}: step {latest.step}, policy version {state['version']}")
    first = timed_sync(trainer, sampler)  # sets up the trainer -> sampler group once
    log(f"weight sync set up: {first['tensors']} tensors, {first['mb']:.3f} MB, {first['wall_s']:.2f}s "
        f"({first['backend']})")
    syncs = []
    start = time.perf_counter()
    batches = endless(gangs["loader"])
    for step in range(first_step, steps + 1):
        t0 = time.perf_counter()
        prompts = next(batches)                            # LazyResult in the loader's worker
        rollouts = sampler.generate(prompts)               # each sampler pulls its half
        scores = reward.score(rollouts)                    # rollouts go sampler -> reward directly
        metrics = trainer.train_step(rollouts, scores)()   # the only value the driver reads
        sync = timed_sync(trainer, sampler)
        history.append(metrics)
        syncs.append(sync)
        log(f"step {step:3d}/{steps}  reward {metrics['reward']:.3f}  loss {metrics['loss']:+.4f}  "
            f"entropy {metrics['entropy']:.2f}  |r-1| {metrics['ratio_err']:.1e}  "
            f"sync {sync['mb']:.3f} MB {sync['seconds']:.4f}s {sync['gb_per_s']:.3f} GB/s "
            f"(wall {sync['wall_s']:.2f}s)  step {time.perf_counter() - t0:.2f}s")
        if ckpt is not None and (step % checkpoint_every == 0 or step == steps):
            t1 = time.perf_counter()
            path = checkpointing.save(ckpt, step, loader=gangs["loader"], gangs=saved_gangs,
                                      version=int(metrics["version"]), history=history)
            saves.append(step)
            log(f"checkpoint: step {step} saved in {path} ({time.perf_counter() - t1:.2f}s)")
    return {"history": history, "sync": syncs, "seconds": time.perf_counter() - start, "first_sync": first,
            "resumed_from": latest.step if latest is not None else None, "checkpoints": saves}


def evaluate_checkpoint(path: str, digits: int, n: int = 200, seed: int = 12345) -> float:
    """Load the HF checkpoint with ``from_pretrained`` and score greedy answers on fresh prompts."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path).eval()
    prompts = make_prompts(n, digits, seed)
    ids = tok(prompts, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=digits,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
    texts = answer_texts(tok, out[:, ids.shape[1]:])
    return float(np.mean([score_text(p, a) for p, a in zip(prompts, texts, strict=True)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps [120; 30 with --quick]")
    parser.add_argument("--quick", action="store_true", help="a short run: 30 steps (about 2 minutes with start-up on 2 busy cores)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per step (global, split over dp=2)")
    parser.add_argument("--group-size", type=int, default=8, help="answers sampled per prompt (GRPO group)")
    parser.add_argument("--digits", type=int, default=4, help="digits per prompt (= answer length)")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    parser.add_argument("--ppo-epochs", type=int, default=4, help="clipped updates per batch")
    parser.add_argument("--entropy-coef", type=float, default=0.1, help="entropy bonus")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model init, data and sampling")
    parser.add_argument("--out-dir", default=None,
                        help="where the reward curve (txt, png) and the HF checkpoint go (default: a "
                             "directory of its own per run, $TMPDIR/rlhf_fsdp_hf-YYYYmmdd-HHMMSS-PID)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save a checkpoint (DIR/step-NNNNNN/, atomic) every --checkpoint-every steps")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue after the newest complete checkpoint in --checkpoint-dir")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be >= 1")
    steps = args.steps or (30 if args.quick else 120)
    lr = args.lr
    out_dir = os.path.abspath(args.out_dir or os.path.join(
        tempfile.gettempdir(), f"rlhf_fsdp_hf-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"))
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "checkpoint")

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    t_start = time.perf_counter()
    # Embedded Ray when run as a script; attaches instead under `ray job submit` (RAY_ADDRESS).
    twinkle.initialize("ray", groups=groups(), seed=args.seed, num_cpus=8)
    phases = {"initialize_s": time.perf_counter() - t_start}
    try:
        print(twinkle.get_device_placement())
        t0 = time.perf_counter()
        gangs = build(digits=args.digits, group_size=args.group_size, batch_size=args.batch_size, lr=lr,
                      ppo_epochs=args.ppo_epochs, entropy_coef=args.entropy_coef, seed=args.seed)
        fsdp = gangs["trainer"].mesh_report()()[0]["fsdp"]
        print(f"trainer: FSDP2 over {fsdp['dim_names']} ranks {fsdp['mesh_ranks']}, "
              f"{fsdp['full_numel']:,} parameters, {fsdp['local_numel']:,} on rank 0")
        phases["gang_startup_s"] = time.perf_counter() - t0
        out = train(gangs, steps, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    resume=args.resume)
        phases["train_s"] = out["seconds"]
        t0 = time.perf_counter()
        gangs["trainer"].save_pretrained(ckpt)()
        phases["save_s"] = time.perf_counter() - t0
    finally:
        t0 = time.perf_counter()
        twinkle.shutdown()
        phases["shutdown_s"] = time.perf_counter() - t0
    rewards = [m["reward"] for m in out["history"]]
    syncs = out["sync"]
    curve = reward_curve(rewards, baseline=RANDOM_POLICY_REWARD, window=5 if steps <= 50 else 10)
    print()
    print(curve)
    k = max(1, min(10, len(rewards) // 4))
    first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    ran = max(1, len(syncs))
    print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}  "
          f"({len(syncs)} steps in {out['seconds']:.1f}s, {out['seconds'] / ran:.2f}s per step)")
    syncs = syncs or [dict(out["first_sync"], seconds=0.0, gb_per_s=0.0, wall_s=0.0)]
    mb = syncs[-1]["mb"]
    print(f"weight sync (per step, from FSDP2 shards): {mb:.3f} MB, {syncs[-1]['tensors']} tensors in "
          f"{syncs[-1]['buckets']} bucket(s), transfer mean {np.mean([s['seconds'] for s in syncs]):.4f}s "
          f"({np.mean([s['gb_per_s'] for s in syncs]):.3f} GB/s), wall incl. gather "
          f"{np.mean([s['wall_s'] for s in syncs]):.3f}s ({syncs[-1]['backend']})")
    with open(os.path.join(out_dir, "reward_curve.txt"), "w") as f:
        f.write(curve + "\n" + "\n".join(f"{i + 1} {r:.4f}" for i, r in enumerate(rewards)) + "\n")
    png = save_plot(rewards, os.path.join(out_dir, "reward_curve.png"), baseline=RANDOM_POLICY_REWARD,
                    title='GRPO on CPU: FSDP2 trainer + HF sampler (twinkle_ray)')
    print(f"reward curve: {os.path.join(out_dir, 'reward_curve.txt')}"
          + (f", {png}" if png else " (PNG skipped: matplotlib is not installed)"))
    t0 = time.perf_counter()
    greedy = evaluate_checkpoint(ckpt, args.digits)
    phases["eval_s"] = time.perf_counter() - t0
    print(f"HF checkpoint: {ckpt} (from_pretrained OK; greedy reward on 200 fresh prompts {greedy:.3f})")
    result = {"steps": len(rewards), "resumed_from": out["resumed_from"], "checkpoints": out["checkpoints"],
              "reward_first": first, "reward_last": last, "rewards": rewards,
              "greedy_reward": greedy, "seconds": out["seconds"], **phases,
              "total_s": time.perf_counter() - t_start, "sync_mb": mb,
              "sync_s": float(np.mean([s["seconds"] for s in syncs])),
              "sync_gb_per_s": float(np.mean([s["gb_per_s"] for s in syncs])),
              "sync_wall_s": float(np.mean([s["wall_s"] for s in syncs])),
              "max_ratio_err": max(m["ratio_err"] for m in out["history"]),
              "checkpoint": ckpt, "png": png}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
