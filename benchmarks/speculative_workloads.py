"""The requests benchmarks/bench_speculative.py and its peer script send: plain text, so the
peer's environment (without vmkv) reads the same ones."""

OPEN = [  # questions whose answers seldom repeat their prompt
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 17 times 23? Show your steps.",
    "Give me a short recipe for pancakes.",
]
PARAGRAPHS = [
    "The KV cache stores every token's keys and values. How that memory is managed decides how many "
    "requests a server can batch, and so its cost.",
    "Paged attention splits the cache into fixed-size blocks and keeps a table per sequence; virtual "
    "memory keeps each sequence contiguous and maps physical pages into it on demand.",
    "A scheduler admits waiting requests while memory lasts, runs every running sequence one token "
    "per step, and preempts the newest when the cache is full.",
    "Speculative decoding guesses several tokens ahead and lets the model check them all in one step, "
    "keeping those it would have produced itself.",
]
FUNCTIONS = [
    """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
""",
    """def count_words(text):
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
""",
    """def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value
""",
    """def first_even(numbers):
    for number in numbers:
        if number % 2 == 0:
            return number
    return None
""",
]


def workloads() -> dict[str, list[str]]:
    return {
        "repeat": [f"Repeat this text exactly, word for word:\n\n{p}" for p in PARAGRAPHS],
        "edit": [
            f"Add a docstring to this Python function and return the whole function:\n\n{f}"
            for f in FUNCTIONS
        ],
        "open": OPEN,
    }
