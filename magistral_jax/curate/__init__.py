"""Curation: the paper's offline data filters that run the policy or the verifiers (paper §3, and
the translated fraction of §2), a room above generate/ and rewards/ so that data/ stays a base
layer. The difficulty filter samples problems with a model and grades the samples with the
verifier pool (difficulty); reference solutions vote on a code problem's tests in the sandbox
(code_filter); a fraction of the problems is translated by a model and checked with the language
detector (translate); filters runs them, with data/'s format filter, over JSONL into a new
dataset plus a report, and run builds the models and the pool they need from the launcher's
options (launch/filter_data.py).
"""
