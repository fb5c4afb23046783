"""Speculative decoding: propose draft tokens, verify them all in one target step, commit the
accepted ones (docs/speculative-decoding.md).

    Proposer (proposer.py: the seam; ngram.py: prompt lookup;   drafts d_1..d_k per decode
              draft_model.py: a smaller engine's greedy tokens, its own paged KV)
        │  SpecDecodeController (controller.py): who may propose, how many (the adaptive rule)
        ▼
    Scheduler: a decode with drafts is one chunk of 1 + k tokens (its last token + the drafts),
        budgeted like any other tokens; KV slots for all of them
        ▼
    one target step: a multi-token query per sequence through the paged-KV attention op (the
        path chunked prefill takes); the network returns logits at every one of those positions
        ▼
    rejection.py: greedy = accept while the target's argmax equals the draft; sampling = standard
        rejection sampling (a point-mass draft: accept d with p(d), else draw from p without d),
        so the committed tokens are distributed exactly as one-by-one decoding's
        ▼
    Scheduler.update: commit accepted + one bonus/correction token; the rejected drafts' KV slots
        are rolled back in the block table (a block left empty is freed)

Every proposer gets the same plain inputs (every candidate's committed tokens and how many drafts
it may give) and returns token ids; one that keeps its own KV (draft_model) finds what the target
accepted by comparing those committed tokens with what its KV holds, and frees a request's KV on
`forget`. An EAGLE/MTP head would also need the target's hidden states (docs/speculative-decoding.md).
"""
