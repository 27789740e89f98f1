"""OpenAI's chat and completions surface (with SageMaker's /invocations, /tokenize, /detokenize, the LoRA routes)."""
