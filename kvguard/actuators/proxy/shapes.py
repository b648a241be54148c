"""How each generation route's body says what it asks: prompts, sequences, answer length.

Every generation route of :mod:`.routes` names a *shape*; :func:`read_generation`
reads a parsed body in that shape into a :class:`Generation`: the prompts (each one
sequence's context, to count), how many sequences each prompt makes (``n``,
``best_of``, ``n_cmpl``, ``num_return_sequences``, an SGLang ``sampling_params.n``),
and where the answer's length is set (``max_tokens``, ``max_completion_tokens``,
``max_output_tokens``, ``max_new_tokens``, ``n_predict``, ``num_predict``), so a cap
rewrites every field the engine could read. Kept apart from :mod:`.admit` because
it is the one place that knows the engines' request formats; the sources are those
the route tables name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvguard.actuators.proxy.screen import MAX_TOKENS_LIMIT

# A key path into a JSON body: ("sampling_params", 0, "max_new_tokens").
FieldPath = tuple[str | int, ...]

# Fields of the OpenAI shapes an engine also reads as the answer's length: llama.cpp
# takes n_predict on its OpenAI routes and prefers it to max_tokens.
_OPENAI_EXTRA_CAPS = ("n_predict",)
# Fields whose negative values mean "no limit" (llama.cpp, Ollama), not a malformed body.
_UNBOUNDED_WHEN_NEGATIVE = frozenset({"n_predict", "num_predict"})
# Fields the existing OpenAI checks hold to 1..MAX_TOKENS_LIMIT; the others may be 0.
_AT_LEAST_ONE = frozenset({"max_tokens", "max_completion_tokens"})


@dataclass(frozen=True)
class Generation:
    """One generation request as the engine will run it.

    ``prompts``: each prompt's subject — a string, token ids, or (``chat``) a list of
    messages. ``samples``: sequences per prompt. ``caps``: the fields that set the
    answer's length, as the client sent them; ``primary``: the field a cap writes
    when the client set none. ``requested``: the largest length the client set
    (None: the engine's default, or no limit).
    """

    prompts: tuple[object, ...]
    chat: bool
    samples: int
    caps: tuple[FieldPath, ...]
    primary: tuple[FieldPath, ...]
    requested: int | None

    @property
    def sequences(self) -> int:
        """Sequences the engine runs for this request: prompts times samples."""
        return max(len(self.prompts), 1) * self.samples


class ShapeError(ValueError):
    """A generation body kvguard must not forward: a field has a type or value no engine takes."""


def read_generation(shape: str, payload: dict[str, Any]) -> Generation | None:
    """``payload`` read as ``shape``, or None when it is no generation request.

    None is for an ``/invocations`` body of a pooling request (vLLM's embeddings).
    Raises :class:`ShapeError` for a body no engine would read as kvguard does.
    """
    if shape == "invocations":
        shape = _sniff_invocation(payload)
        if shape == "pooling":
            return None
    reader = _READERS.get(shape)
    if reader is None:
        raise ValueError(f"no such request shape: {shape}")
    return reader(payload)


def clamp(payload: dict[str, Any], generation: Generation, max_tokens: int) -> None:
    """Write ``max_tokens`` into every length field of ``payload`` the engine could read.

    Those the client set, else the shape's primary field(s) (their parent objects
    made when missing): an engine that prefers another field than the one kvguard
    wrote would not be capped.
    """
    for path in generation.caps or generation.primary:
        _set(payload, path, max_tokens)


def _sniff_invocation(payload: dict[str, Any]) -> str:
    """The shape of a SageMaker ``/invocations`` body (vLLM, SGLang and TGI take several)."""
    if "messages" in payload:
        return "chat"
    if "inputs" in payload:
        return "native_generate"  # TGI's generate request
    if "text" in payload or "input_ids" in payload:
        return "native_generate"  # SGLang's
    if "input" in payload and "prompt" not in payload:
        return "pooling"  # vLLM's embedding and pooling requests: no decode to account
    return "completions"


# ---------------------------------------------------------------------------- readers
def _completions(payload: dict[str, Any]) -> Generation:
    prompts = _openai_prompts(payload.get("prompt"))
    samples = _samples(payload, "n", "best_of", "n_cmpl")
    return _with_caps(payload, prompts, False, samples, ("max_tokens", *_OPENAI_EXTRA_CAPS))


def _chat(payload: dict[str, Any]) -> Generation:
    messages = payload.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        prompts: tuple[object, ...] = tuple(messages)  # vLLM's batch: one conversation each
    else:
        prompts = (messages,)
    samples = _samples(payload, "n", "n_cmpl")
    keys = ("max_completion_tokens", "max_tokens", *_OPENAI_EXTRA_CAPS)
    generation = _with_caps(payload, prompts, True, samples, keys)
    if not generation.caps:  # a cap sets max_tokens, which every engine reads
        return _replace_primary(generation, (("max_tokens",),))
    return generation


def _responses(payload: dict[str, Any]) -> Generation:
    given = payload.get("input")
    items: list[object] = list(given) if isinstance(given, list) else [_user(given)]
    instructions = payload.get("instructions")
    if instructions is not None:
        items.insert(0, {"role": "system", "content": instructions})
    return _with_caps(payload, (items,), True, 1, ("max_output_tokens",))


def _messages(payload: dict[str, Any]) -> Generation:
    messages = payload.get("messages")
    items: list[object] = list(messages) if isinstance(messages, list) else [_user(messages)]
    system = payload.get("system")
    if system is not None:
        items.insert(0, {"role": "system", "content": system})
    return _with_caps(payload, (items,), True, 1, ("max_tokens",))


def _native_generate(payload: dict[str, Any]) -> Generation:
    if "inputs" in payload:  # TGI: one prompt, its parameters in "parameters"
        parameters = _object(payload, "parameters")
        samples = _samples(parameters, "best_of", "n")
        generation = _with_caps(
            parameters, (payload.get("inputs"),), False, samples, ("max_new_tokens",)
        )
        return _under("parameters", generation)
    return _sglang_generate(payload)


def _sglang_generate(payload: dict[str, Any]) -> Generation:
    prompts: tuple[object, ...]
    text, ids = payload.get("text"), payload.get("input_ids")
    embeds = payload.get("input_embeds")
    if isinstance(text, list):
        prompts = tuple(text)
    elif text is not None:
        prompts = (text,)
    elif isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        prompts = tuple(ids)
    elif ids is not None:
        prompts = (ids,)
    elif isinstance(embeds, list) and embeds and isinstance(embeds[0], list):
        # One vector per token, so a prompt's length is known without its text: stand-in
        # token ids of that length. A list of such lists is a batch.
        batch = bool(embeds[0]) and isinstance(embeds[0][0], list)
        prompts = tuple([0] * len(p) for p in embeds) if batch else ([0] * len(embeds),)
    else:
        prompts = (None,)
    params = payload.get("sampling_params")
    if params is None:
        params = {}
    if isinstance(params, dict):
        samples = _samples(params, "n")
        generation = _with_caps(params, prompts, False, samples, ("max_new_tokens",))
        return _under("sampling_params", generation)
    if not isinstance(params, list) or not all(isinstance(p, dict) for p in params):
        raise ShapeError("sampling_params must be an object or a list of objects")
    # One per prompt: every prompt may set its own length and samples.
    parts = [_with_caps(p, prompts, False, _samples(p, "n"), ("max_new_tokens",)) for p in params]
    lengths = [p.requested for p in parts]
    requested = None if None in lengths or not lengths else max(x for x in lengths if x is not None)
    caps = tuple(("sampling_params", i, *c) for i, p in enumerate(parts) for c in p.caps)
    primary = tuple(("sampling_params", i, "max_new_tokens") for i in range(len(parts)))
    samples = max((p.samples for p in parts), default=1)
    return Generation(prompts, False, samples, caps, primary, requested)


def _llama(payload: dict[str, Any]) -> Generation:
    given = payload.get("prompt")
    if isinstance(given, list) and given and not any(isinstance(p, int) for p in given):
        prompts: tuple[object, ...] = tuple(given)  # several prompts, one task each
    else:
        prompts = (given,)  # a string, token ids, or ids mixed with strings: one prompt
    infill = [payload.get(k) for k in ("input_prefix", "input_suffix", "input_extra")]
    if any(part is not None for part in infill):  # /infill: the context is all of them
        prompts = tuple([*infill, p] for p in prompts)
    samples = _samples(payload, "n_cmpl", "n")
    generation = _with_caps(
        payload, prompts, False, samples, ("n_predict", "max_completion_tokens", "max_tokens")
    )
    return _replace_primary(generation, (("n_predict",),))  # llama.cpp reads it first


def _triton(payload: dict[str, Any]) -> Generation:
    samples = _samples(payload, "num_return_sequences", "beam_width")
    return _with_caps(payload, (payload.get("text_input"),), False, samples, ("max_tokens",))


def _ollama_chat(payload: dict[str, Any]) -> Generation:
    options = _object(payload, "options")
    generation = _with_caps(options, (payload.get("messages"),), True, 1, ("num_predict",))
    return _under("options", generation)


def _ollama_generate(payload: dict[str, Any]) -> Generation:
    options = _object(payload, "options")
    subject = [payload.get("system"), payload.get("prompt")]
    generation = _with_caps(options, (subject,), False, 1, ("num_predict",))
    return _under("options", generation)


_READERS = {
    "completions": _completions,
    "chat": _chat,
    "responses": _responses,
    "messages": _messages,
    "native_generate": _native_generate,
    "llama": _llama,
    "triton": _triton,
    "ollama_chat": _ollama_chat,
    "ollama_generate": _ollama_generate,
}
SHAPES = frozenset({*_READERS, "invocations"})


# ---------------------------------------------------------------------------- helpers
def _openai_prompts(prompt: object) -> tuple[object, ...]:
    """OpenAI's ``prompt``: a string, token ids, or a batch of either."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return tuple(prompt)
    return (prompt,)


def _user(content: object) -> dict[str, object]:
    return {"role": "user", "content": content}


def _object(payload: dict[str, Any], key: str) -> dict[str, Any]:
    value = payload.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ShapeError(f"{key} must be an object, not {type(value).__name__}")
    return value


def _samples(payload: dict[str, Any], *keys: str) -> int:
    """Sequences per prompt: the largest of the fields set (1 when none is)."""
    samples = 1
    for key in keys:
        value = payload.get(key)
        if value is None:
            continue
        # A string or float here would be read as a number by pydantic's lax mode
        # (vLLM, SGLang) while kvguard counted one sequence: refused.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShapeError(f"{key} must be an integer, not {type(value).__name__}")
        if not 1 <= value <= MAX_TOKENS_LIMIT:
            raise ShapeError(f"{key} must be from 1 to {MAX_TOKENS_LIMIT}, not {value}")
        samples = max(samples, value)
    return samples


def _with_caps(
    where: dict[str, Any],
    prompts: tuple[object, ...],
    chat: bool,
    samples: int,
    keys: Sequence[str],
) -> Generation:
    """A :class:`Generation` whose length fields are ``keys`` of ``where``."""
    caps: list[FieldPath] = []
    lengths: list[int | None] = []
    for key in keys:
        value = where.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShapeError(f"{key} must be an integer, not {type(value).__name__}")
        if value < 0 and key in _UNBOUNDED_WHEN_NEGATIVE:
            lengths.append(None)  # no limit: the engine generates until the context is full
        else:
            low = 1 if key in _AT_LEAST_ONE else 0
            if not low <= value <= MAX_TOKENS_LIMIT:
                raise ShapeError(f"{key} must be from {low} to {MAX_TOKENS_LIMIT}, not {value}")
            lengths.append(value)
        caps.append((key,))
    known = [x for x in lengths if x is not None]
    requested = max(known) if known and len(known) == len(lengths) else None
    return Generation(prompts, chat, samples, tuple(caps), ((keys[0],),), requested)


def _under(key: str, generation: Generation) -> Generation:
    """``generation`` with its field paths moved under ``key`` of the body."""
    return Generation(
        generation.prompts,
        generation.chat,
        generation.samples,
        tuple((key, *path) for path in generation.caps),
        tuple((key, *path) for path in generation.primary),
        generation.requested,
    )


def _replace_primary(generation: Generation, primary: tuple[FieldPath, ...]) -> Generation:
    return Generation(
        generation.prompts,
        generation.chat,
        generation.samples,
        generation.caps,
        primary,
        generation.requested,
    )


def _set(payload: dict[str, Any], path: FieldPath, value: int) -> None:
    """Set ``path`` in ``payload`` to ``value``, making missing objects on the way."""
    node: Any = payload
    for step in path[:-1]:
        if isinstance(step, int):
            node = node[step]
            continue
        child = node.get(step)
        if child is None:
            child = node[step] = {}
        node = child
    node[path[-1]] = value
