"""How each generation route's body says what it asks: prompts, sequences, answer length.

Every generation route of :mod:`.routes` names a *shape*; :func:`read_generation`
reads a parsed body in that shape into a :class:`Generation`: the prompts (each one
sequence's context, to count), how many sequences each prompt makes (``n``,
``best_of``, ``n_cmpl``, ``num_return_sequences``, an SGLang ``sampling_params.n``),
and where the answer's length is set (``max_tokens``, ``max_completion_tokens``,
``max_output_tokens``, ``max_new_tokens``, ``n_predict``, ``num_predict``), so a cap
rewrites every field the engine could read. Where a path takes several formats
(``/invocations``, ``/generate``), the route's shape names its engine, and the body
is read as that engine dispatches it; a body carrying the fields of two formats is
refused. Kept apart from :mod:`.admit` because it is the one place that knows the
engines' request formats; the sources are those the route tables name.
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
    Raises :class:`ShapeError` for a body no engine would read as kvguard does: on a
    route whose engines take several formats (``/invocations``, ``/generate``), one
    carrying the fields of more than one, or of a format the engine does not take.
    """
    dispatch = _DISPATCH.get(shape)
    if dispatch is not None:
        found = _format_of(dispatch, payload)
        if found is None:
            return None
        shape = found
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


# ------------------------------------------------------------- routes of several formats
@dataclass(frozen=True)
class _Format:
    """A request format a route may take: the fields that mark it and its reader.

    ``marks`` are the format's prompt and length fields: a body carrying one is in
    this format. ``shape``: the reader; None for a request that does not generate.
    """

    name: str
    marks: tuple[str, ...]
    shape: str | None


_CHAT = _Format("chat completion", ("messages",), "chat")
_COMPLETION = _Format("completion", ("prompt", "prompt_embeds"), "completions")
_POOLING = _Format("vLLM pooling", ("input",), None)
_TGI = _Format("TGI generate", ("inputs", "parameters"), "tgi_generate")
_SGLANG = _Format(
    "SGLang generate", ("text", "input_ids", "input_embeds", "sampling_params"), "sglang_generate"
)


@dataclass(frozen=True)
class _Dispatch:
    """How one engine (or, while the kind is unknown, any) picks a route's format.

    ``takes``: the formats the engine takes there, in the order it tries them;
    ``route``: every format any engine takes on that path, so that a body carrying
    the fields of two is refused whichever engine serves it; ``bare``: the shape of
    a body carrying none (None: not a generation request).
    """

    engine: str
    takes: tuple[_Format, ...]
    route: tuple[_Format, ...]
    bare: str | None


_INVOCATIONS = (_CHAT, _COMPLETION, _TGI, _POOLING)
_GENERATE = (_SGLANG, _TGI)
# Each engine's own dispatch, from the source routes.py names:
# * vLLM 0.32.0, entrypoints/serve/sagemaker/api_router.py: the first of
#   ChatCompletionRequest (messages), CompletionRequest (prompt or prompt_embeds), then
#   the pooling requests, that validates (generate/factories.py, pooling/factories.py);
# * SGLang 0.5.23, srt/entrypoints/http_server.py: /invocations takes a
#   ChatCompletionRequest only; /generate a GenerateReqInput (text, input_ids or
#   input_embeds; sampling_params);
# * TGI v3.3.7, router/src/sagemaker.rs: an untagged enum tried in order, Generate
#   (inputs, parameters), Chat (messages), Completion (prompt); /, /generate and
#   /generate_stream take a generate request.
# A body whose fields match two formats would be read by whichever the engine's
# deserialiser accepts first, a choice kvguard cannot see: refused.
_DISPATCH: dict[str, _Dispatch] = {
    "vllm_invocations": _Dispatch("vLLM", (_CHAT, _COMPLETION, _POOLING), _INVOCATIONS, None),
    "sglang_invocations": _Dispatch("SGLang", (_CHAT,), _INVOCATIONS, "chat"),
    "tgi_invocations": _Dispatch("TGI", (_TGI, _CHAT, _COMPLETION), _INVOCATIONS, "tgi_generate"),
    "sglang_generate": _Dispatch("SGLang", (_SGLANG,), _GENERATE, "sglang_generate"),
    "tgi_generate": _Dispatch("TGI", (_TGI,), _GENERATE, "tgi_generate"),
    # The engine's kind unknown: whichever one format the body is in.
    "invocations": _Dispatch("any engine", _INVOCATIONS, _INVOCATIONS, "completions"),
    "native_generate": _Dispatch("any engine", _GENERATE, _GENERATE, "sglang_generate"),
}


def _format_of(dispatch: _Dispatch, payload: dict[str, Any]) -> str | None:
    """The shape ``payload`` is read in under ``dispatch``; None: no generation request."""
    found = [
        (form, [key for key in form.marks if key in payload])
        for form in dispatch.route
        if any(key in payload for key in form.marks)
    ]
    if len(found) > 1:
        fields = "; ".join(f"{', '.join(keys)} ({form.name})" for form, keys in found)
        raise ShapeError(
            f"the body carries the fields of more than one request format: {fields};"
            " an engine reads one, so send the fields of one"
        )
    if not found:
        return dispatch.bare
    form, keys = found[0]
    if form not in dispatch.takes:
        raise ShapeError(
            f"{', '.join(keys)} ({form.name}) is not a request format {dispatch.engine}"
            " takes on this route"
        )
    if form is _CHAT and not isinstance(payload["messages"], list):
        raise ShapeError(f"messages must be a list, not {type(payload['messages']).__name__}")
    return form.shape


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
    # llama.cpp turns the body into a chat request, every other field kept
    # (server-chat.cpp, server_chat_convert_responses_to_chatcmpl), so it also reads
    # max_tokens, max_completion_tokens and n_predict there.
    keys = ("max_output_tokens", "max_tokens", "max_completion_tokens", *_OPENAI_EXTRA_CAPS)
    return _with_caps(payload, (items,), True, 1, keys)


def _messages(payload: dict[str, Any]) -> Generation:
    # llama.cpp builds a new chat request from the Anthropic one with max_tokens only
    # (server_chat_convert_anthropic_to_oai): n_predict is not read there.
    messages = payload.get("messages")
    items: list[object] = list(messages) if isinstance(messages, list) else [_user(messages)]
    system = payload.get("system")
    if system is not None:
        items.insert(0, {"role": "system", "content": system})
    return _with_caps(payload, (items,), True, 1, ("max_tokens",))


def _tgi_generate(payload: dict[str, Any]) -> Generation:
    """TGI's generate request: one prompt, its parameters in ``parameters``."""
    parameters = _object(payload, "parameters")
    samples = _samples(parameters, "best_of", "n")
    generation = _with_caps(
        parameters, (payload.get("inputs"),), False, samples, ("max_new_tokens",)
    )
    return _under("parameters", generation)


def _sglang_generate(payload: dict[str, Any]) -> Generation:
    given = [key for key in ("text", "input_ids", "input_embeds") if key in payload]
    if len(given) > 1:
        # SGLang sizes the batch from text but runs input_ids (tokenizer_manager.py):
        # kvguard would count the one the engine does not run.
        raise ShapeError(f"the body sets {' and '.join(given)}: send one of them")
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
    "tgi_generate": _tgi_generate,
    "sglang_generate": _sglang_generate,
    "llama": _llama,
    "triton": _triton,
    "ollama_chat": _ollama_chat,
    "ollama_generate": _ollama_generate,
}
SHAPES = frozenset({*_READERS, *_DISPATCH})


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
        if key not in where:
            continue
        value = where[key]
        if value is None:
            # Sent as null: the engine reads it as unset, but a cap written elsewhere
            # could lose to it in an engine that prefers this field; the cap goes here.
            caps.append((key,))
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
