"""``run.eval_greedy`` (held-out answers decoded greedily) and ``model.alphabet`` (the embedded tokenizer's
characters): what configs/code.yaml runs with."""

from __future__ import annotations

import torch

from hyperrl.config import load_config


def test_greedy_evaluation_is_the_policys_argmax_and_an_alphabet_is_the_tokenizers_vocabulary(tmp_path):
    from hyperrl.compose import build
    from hyperrl.tokenizer import encode_prompt

    def trainer(greedy: bool):
        return build(load_config(None, [f"--run.out_dir={tmp_path}", "--model.alphabet=0123456789+=",
                                        f"--run.eval_greedy={str(greedy).lower()}", "--run.eval_prompts=12",
                                        "--rollout.max_new_tokens=3"]))

    tr = trainer(True)
    # <pad> <bos> <eos> and the 12 characters: the model's vocabulary follows the tokenizer's
    assert len(tr.tok) == 15 and tr.policy.get_input_embeddings().num_embeddings == 15
    # the greedy answers are the model's argmax: transformers' greedy decoding of the same prompts
    samples = tr.task.held_out(12)
    want = []
    for s in samples:
        ids = torch.tensor([encode_prompt(tr.tok, s.prompt)])
        out = tr.policy.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=tr.tok.eos_token_id,
                                 pad_token_id=tr.tok.pad_token_id)[0, ids.shape[1]:].tolist()
        want.append(out[:out.index(2) + 1] if 2 in out else out)
    sampling = tr.evaluator.generator.sampling(0, seed_offset=10**6)
    greedy = tr.evaluator.generator.generate(samples, sampling.__class__(**{**vars(sampling), "top_k": 1}), 1)
    got = [r[m.bool()].tolist() for r, m in zip(greedy["tokens"], greedy["action_mask"])]
    assert got == want
    # and the evaluation does not depend on the sampling seed; sampled, it does
    metrics = {}
    for greedy_eval in (True, False):
        t = tr if greedy_eval else trainer(False)
        runs = []
        for seed in (0, 1):
            t.evaluator.generator.seed = seed
            runs.append(t.evaluator.evaluate(0))
        metrics[greedy_eval] = runs
    assert metrics[True][0] == metrics[True][1]
    assert metrics[False][0] != metrics[False][1]
