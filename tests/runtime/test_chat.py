"""The chat REPL with scripted stdin, and the chat template rendering it shares with the server."""

import dataclasses
import io
import threading
import time

import pytest

from llmc.chat_template import NO_TEMPLATE_NOTICE, TemplateLimits, compile_template, render_chat
from llmc.errors import ArtifactError, RequestError
from llmc.runtime.chat import run_chat
from llmc.runtime.chat_template import chat_prompt_ids
from llmc.runtime.engine import LLMEngine
from llmc.sampling_params import SamplingParams
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@dataclasses.dataclass(frozen=True)
class Config(FakeConfig):
    bos_token_id: int = 0


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def config(tok):
    return Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=256)


def new_engine(tok, config):
    return LLMEngine(FakeModel(config, num_blocks=64, block_size=8), tok, seed=0)


class Recorder(io.StringIO):
    """stdout that remembers each write, to see the reply arrive in pieces."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def reply_for(tok, config, messages, template=TEMPLATE):
    ids = chat_prompt_ids(tok, template, messages, "<s>", "</s>")
    return new_engine(tok, config).generate([ids], PARAMS)[0].outputs[0].text


def test_conversation_history_reset_and_exit(tok, config):
    out = Recorder()
    script = "hello there\nand the fox?\n/reset\n\nhello there\n/exit\nnever read\n"
    history = run_chat(new_engine(tok, config), tok, TEMPLATE, PARAMS, input=io.StringIO(script), output=out)

    first = reply_for(tok, config, [{"role": "user", "content": "hello there"}])
    second = reply_for(
        tok,
        config,
        [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and the fox?"},
        ],
    )
    assert first and second and first != second
    text = out.getvalue()
    assert text.count(first + "\n") >= 2  # the same answer after /reset: the history was cleared
    assert second + "\n" in text
    assert "(new conversation)" in text
    assert history == [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first}]
    # streamed: the reply arrived in several writes, not one
    assert sum(1 for w in out.writes if w and w in first) > 3
    assert ">>>" not in text  # no prompt when stdin is not a terminal


def test_end_of_input_quits_and_system_prompt(tok, config):
    out = io.StringIO()
    history = run_chat(
        new_engine(tok, config), tok, TEMPLATE, PARAMS, input=io.StringIO("hi"), output=out, system_prompt="be brief"
    )
    want = reply_for(tok, config, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert history[-1] == {"role": "assistant", "content": want}
    assert out.getvalue().endswith(want + "\n")


def test_no_template_falls_back_to_a_transcript_and_says_so_once(tok, config):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "x"},
    ]
    assert render_chat(None, messages, "<s>") == "<s>user: hi\nassistant: yo\nuser: x\nassistant:"
    out = io.StringIO()
    run_chat(new_engine(tok, config), tok, None, PARAMS, input=io.StringIO("hi\nagain\n"), output=out)
    assert out.getvalue().count(NO_TEMPLATE_NOTICE) == 1
    want = reply_for(tok, config, [{"role": "user", "content": "hi"}], template=None)
    assert want + "\n" in out.getvalue()


def test_a_too_long_turn_is_reported_and_the_chat_goes_on(tok, config):
    out = io.StringIO()
    script = "z" * 400 + "\nhello there\n"
    history = run_chat(new_engine(tok, config), tok, TEMPLATE, PARAMS, input=io.StringIO(script), output=out)
    assert "error: the prompt has" in out.getvalue() and "/reset" in out.getvalue()
    assert [m["role"] for m in history] == ["user", "assistant"] and history[0]["content"] == "hello there"


def test_template_rendering_like_transformers():
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}[U]{{ m['content'] | trim }}"
        "{% elif m['role'] == 'assistant' %}[A]{{ m['content'] }}{{ eos_token }}"
        "{% else %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}[A]{% endif %}{{ {'k': 'é'} | tojson }}"
    )
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    # trim_blocks: the newline after a block tag goes, as in transformers
    assert render_chat(template, messages, "<s>", "</s>") == '[U]hi[A]yo</s>[A]{"k": "é"}'
    assert render_chat(template, messages, "<s>", "</s>", add_generation_prompt=False) == '[U]hi[A]yo</s>{"k": "é"}'
    with pytest.raises(RequestError, match="bad role tool"):
        render_chat(template, [{"role": "tool", "content": "x"}])
    with pytest.raises(ArtifactError, match="does not parse"):
        render_chat("{% for %}", messages)
    # HF may store several named templates
    assert render_chat([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}], messages) == "D"


LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = """{{ bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- ' [INST] ' + message['content'] + ' [/INST]' }}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""


@pytest.mark.parametrize("template", [LLAMA3, MISTRAL, TEMPLATE], ids=["llama3", "mistral", "simple"])
def test_render_chat_equals_transformers(template):
    cu = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = [
        {"role": "user", "content": "  hi é 🙂 "},
        {"role": "assistant", "content": "yo\n"},
        {"role": "user", "content": "and then?"},
    ]
    for add in (True, False):
        (want,), _ = cu.render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=add, bos_token="<s>", eos_token="</s>"
        )
        assert render_chat(template, messages, "<s>", "</s>", add_generation_prompt=add) == want
    if template is MISTRAL:
        with pytest.raises(RequestError, match="roles must alternate"):
            render_chat(template, messages[:1] * 2, "<s>", "</s>")


# -- hostile templates: the checkpoint's code runs under bounds ----------------------------------------------

SQUARING = "{% set ns = namespace(x=3) %}{% for i in range(20) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 5 }}"
DOUBLING = "{{% set ns = namespace(s='x') %}}{{% for i in range(24) %}}{{% set ns.s = {} %}}{{% endfor %}}{{{{ ns.s|length }}}}"
C_CALL_STALL = "{% set a = ['x'] * 100000 %}{% set b = ['x'] * 100000 %}{{ [a] * 50000 == [b] * 50000 }}"


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "unsafe"),  # Python internals
        ("{{ ().__class__.__base__.__subclasses__() }}", "unsafe"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than"),
        ("{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}", "took more than"),
        ("{{ 'a' * 1000000000 }}", "'\\*' asks for"),  # no constant folding at compile time either
        ("{{ 9 ** 100000000 }}", "'\\*\\*' would build"),
        ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output passed"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
        # strings of a size the template names, built in one C call: checked before they are built
        ("{{ '{:1000000000}'.format(1) }}", "str.format spec"),
        ("{{ '{:.{w}f}'.format(1.0, w=10**9) }}", "nested"),
        ("{{ '%1000000000d' % 1 }}", "'%' conversion"),
        ("{{ '%*d' % (1000000000, 1) }}", "'%' conversion"),
        ("{{ '%1000000000d'|format(1) }}", "'%' conversion"),
        ("{{ 'x'.center(1000000000) }}", "str.center"),
        ("{{ 'x'.zfill(1000000000) }}", "str.zfill"),
        ("{{ 'x'|center(1000000000) }}", "center filter"),
        ("{{ 'a\nb'|indent(1000000000) }}", "indent filter"),
        # values built by one operator, sized before it runs (a big-int operation is one C call holding the GIL)
        ("{{ (10 ** 1024) ** 1024 > 5 }}", "'\\*\\*' would build"),
        (SQUARING, "'\\*' would build"),
        (DOUBLING.format("ns.s ~ ns.s"), "'~' would build"),
        (DOUBLING.format("ns.s + ns.s"), "'\\+' would build"),
        (DOUBLING.replace("s='x'", "s=[1]").format("ns.s + ns.s"), "'\\+' would build"),
        ("{{ (['x' * 1000] * 2000)|join|length }}", "join filter"),
        ("{{ ''.join(['x' * 1000] * 2000)|length }}", "str.join"),
        # one C call the bounds above do not size (10^10 comparisons): the render's process is killed
        (C_CALL_STALL, "took more than"),
    ],
)
def test_a_hostile_template_is_refused_with_an_artifact_error(template, match):
    limits = TemplateLimits(timeout_s=0.5, max_output_chars=1 << 20)
    start = time.monotonic()
    with pytest.raises(ArtifactError, match=match):
        render_chat(template, [{"role": "user", "content": "hi"}], limits=limits)
    assert time.monotonic() - start < 3
    assert render_chat(TEMPLATE, [{"role": "user", "content": "hi"}], "<s>", "</s>", limits=limits) == (
        "<s><|user|>hi</s><|assistant|>"
    )  # the process goes on


def test_a_template_too_large_or_broken_is_refused_at_load():
    with pytest.raises(ArtifactError, match="characters, more than"):
        compile_template("x" * 1001, TemplateLimits(max_template_chars=1000))
    with pytest.raises(ArtifactError, match="does not parse"):
        compile_template("{% if %}")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ((10 ** 1024) ** 1024) ** 32 > 5 }}",  # 44 s in one C call, every thread of the process stalled
        "{% set ns = namespace(s='x') %}{% for i in range(28) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",  # 268 M
    ],
    ids=["power", "concat"],
)
def test_the_issue_33_bombs_are_refused_before_they_run(template):
    start = time.monotonic()
    with pytest.raises(ArtifactError, match="would build"):
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 2


def test_a_render_stuck_in_one_c_call_stalls_no_other_thread():
    gaps, done = [], threading.Event()

    def heartbeat():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.01)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        start = time.monotonic()
        with pytest.raises(ArtifactError, match="took more than 0.5 s"):
            render_chat(C_CALL_STALL, [{"role": "user", "content": "hi"}], limits=TemplateLimits(timeout_s=0.5))
        assert time.monotonic() - start < 2
    finally:
        done.set()
        beat.join()
    assert max(gaps) < 0.3  # the GIL was free all along: the render ran elsewhere
    assert render_chat(TEMPLATE, [{"role": "user", "content": "hi"}]) == "<|user|>hi<|assistant|>"


def test_a_render_is_bounded_in_memory():
    limits = TemplateLimits(max_memory_bytes=256 << 20)
    with pytest.raises(ArtifactError, match="memory"):  # one str() of a list: 400 MB in one C call
        render_chat("{{ (['x' * 1000000] * 400)|string|length }}", [{"role": "user", "content": "hi"}], limits=limits)
