"""Evaluators: features in, numbers out (k-NN, linear and attentive probes, few-shot, fine-tuning, segmentation,
zero-shot and retrieval); `run` composes them for scripts/evaluate.py."""
