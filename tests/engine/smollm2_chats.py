"""The chats the SmolLM2 tests ask (test_smollm2.py on CPU, test_cuda.py on a GPU)."""

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a prime number is.",
    "List three colors of the rainbow.",
]
