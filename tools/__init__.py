"""Research tools outside the runtime package: the optimizer study and its report, Hugging Face
export/import, lm-eval."""
