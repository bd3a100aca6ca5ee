"""Magistral's GRPO variant as pure functions, in the order a reward flows through them:
group advantages and the drop decision (advantages), minibatches with normalised advantages
(minibatch), greedy collation into packed microbatches (collate), and the loss (loss)."""
