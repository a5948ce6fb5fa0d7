"""Host memory the pipeline holds: the budget it is counted against (:mod:`.budget`) and the
ring of reused chunk buffers that streamed snapshots and staged restores go through
(:mod:`.ring`)."""
