"""What the training prompts hold, parsed out for `augment`: passages, questions, dialogues, sentences, topics.

    material = parse_material(load_train_prompts("train_prompts.jsonl"))
    material.passages[0]  # Piece(text="Jardim, in charge since 2014, ...", source="t0:xsum_DOC_tldr")

The T0 templates wrap one example each in an instruction; the parsers below unwrap them by shape, not
by template name (the longest prose block is the passage; ``Question:`` / ``Q:`` lines or a short line
ending in ``?`` are questions; runs of ``Name: text`` lines are dialogues), so a new template of the
same shape parses too. Every piece keeps the source of the prompt it came from. Everything is in
prompt-file order (no sets, no hashing): the same prompts give the same material.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import attrs


@attrs.frozen
class Piece:
    text: str
    source: str


@attrs.frozen
class QAPair:
    passage: str
    question: str
    source: str


@attrs.frozen
class Material:
    passages: list[Piece]  # prose, 40+ words, cleaned (a news article, a review, a movie plot, a paragraph)
    qa: list[QAPair]  # a passage and a question about it, from the same prompt
    questions: list[Piece]  # questions that stand alone (TREC, HotpotQA, closed-book SciQ, CommonsenseQA)
    dialogues: list[Piece]  # "Name: text" lines, 3+ turns, 2+ speakers
    sentences: list[Piece]  # single well-formed sentences of 8-32 words, cut from passages
    concepts: list[Piece]  # comma-separated word sets (CommonGen) and single-word topics
    topics: list[Piece]  # headlines, product and movie titles, entry names, one-line news (Gigaword)
    facts: list[Piece]  # one-sentence science facts (QASC, SciQ support) and process steps (WIQA)
    problems: list[Piece]  # GSM8K word problems
    instructions: list[Piece]  # Self-Instruct instructions (the first paragraph)

    def counts(self) -> dict[str, int]:
        return {field.name: len(getattr(self, field.name)) for field in attrs.fields(Material)}


# Templates whose examples carry real prose (articles, reviews, plots, paragraphs); the others wrap
# sentence pairs, questions or their own framing prose ("I'm an administrator on the website Quora...").
PASSAGE_SOURCES = (
    "adversarial_qa", "ag_news", "amazon", "app_reviews", "cnn_dailymail", "cosmos_qa", "dbpedia", "duorc",
    "imdb", "multi_news", "quoref", "ropes", "sciq", "xsum", "yelp", "self_instruct", "quartz", "wiki_hop",
)  # fmt: skip
# Lines of a T0 template, never material: instructions and answer slots.
_BOILERPLATE = re.compile(
    r"\b(answer the|the following|following question|the above|paraphrase|this review|this product|"
    r"the reviewer|is this asking|yes or no|guess who|options|choose|choices|pick one|which of the|"
    r"best describes|what label|this text|this article|the passage|the context|given the|based on|"
    r"what category|the sentence|this sentence|rating|stars?|sentiment|tone|summar\w*|title|generate|"
    r"write a|what might be|the process|the question|correct answer|is that a|true or false|piece of news|"
    r"which section|categor\w+|the text|recap\w*|rephrase|abstract|tl;?dr|validate|suggested answer|"
    r"feel about|considering whether|flattering|satisfied|dissatisfied)\b",
    re.IGNORECASE,
)
# A line that only frames the example: an answer slot, a label, a separator, a multiple-choice option.
_TEMPLATE_LINE = re.compile(
    r"^(?:={2,}|(?:question|q|a|answer|options?|title|review title|topic|stars|summary|hint)\s*:.*|"
    r"[A-D][.)] .{0,200}|- .{0,200}|.{0,40}:)$",
    re.IGNORECASE,
)
# "I read this background article the other day: ...", "Summarize this document: ...", "Movie plot: ...".
_LEAD_IN = re.compile(
    r"^[\w ,'\u2019]{0,60}?\b(?:background(?: article the other day)?|situation|context|article|document|"
    r"summari[sz]e|in brief|review(?: text)?|movie plot|bio|passage|paragraph|hint|text|dialogue|"
    r"information|abstract|means|story)\s*:\s*",
    re.IGNORECASE,
)
_SPEAKER = re.compile(r"^([A-Z][A-Za-z.'\-]{0,20}(?: [A-Z][A-Za-z.'\-]{0,20})?):\s+(\S.*)$")
_NOT_SPEAKERS = {
    "Question", "Answer", "Q", "A", "Dialogue", "Summary", "Options", "Note", "Context", "Title", "Review",
    "Document", "Article", "Sentence", "Sentence 1", "Sentence 2", "Bio", "Information", "Fact", "Fact 1",
    "Fact 2", "Background", "Paragraph", "Movie plot", "Movie title", "Movie plot title", "Product review",
    "Review title", "Choices", "Input", "Output", "Passage", "Text", "Hint", "Situation", "Topic", "Story",
    "Example", "TL;DR", "Claim", "Premise", "Hypothesis", "Conversation", "Summarize", "Summarise",
}  # fmt: skip
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[A-Z\"'(])")
_ABBREVIATION = re.compile(
    r"(?:\b[A-Z]|\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Prof|Gen|Col|Lt|Sgt|Rep|Sen|Gov|vs|No|Inc|Co|Corp|Ltd|U\.S|U\.K|e\.g|i\.e|approx|Mt|Ft))\.$"
)
_TOKENIZED = re.compile(r" [,.;:!?)](?:\s|$)| 's\b| n't\b|-lrb-|-rrb-|``|''| ##|#\d")


def words(text: str) -> list[str]:
    return text.split()


def clean(text: str) -> str:
    """Whitespace squeezed, literal ``\\n`` (Yelp) made real, a quoted passage unquoted."""
    text = text.replace("\\n", "\n").replace("\u00a0", " ")
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\s*\n\s*", "\n", text).strip()
    bare = text.rstrip(",").strip()
    if len(bare) > 2 and bare[0] == '"' and bare[-1] == '"' and '"' not in bare[1:-1].replace('\\"', ""):
        text = bare[1:-1].strip()
    elif len(bare) > 2 and bare[0] == '"' and bare[-1] == '"':
        text = bare[1:-1].strip() if bare.count('"') % 2 == 0 and bare[1:-1].count('"') % 2 == 0 else text
    return text


def detokenize(text: str) -> str:
    """Undo Penn-Treebank spacing (``don 't`` -> ``don't``, `` , `` -> ``,``, ``-lrb-`` -> ``(``)."""
    text = text.replace("-lrb-", "(").replace("-rrb-", ")").replace("``", '"').replace("''", '"')
    text = re.sub(r" ([,.;:!?%)])", r"\1", text)
    text = re.sub(r"\( ", "(", text)
    text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)
    text = re.sub(r"(\w) '(t|s|re|ve|ll|d|m)\b", r"\1'\2", text)
    return re.sub(r'" ([^"]+?) "', r'"\1"', text)


def is_prose(text: str) -> bool:
    """Mostly letters, sentence punctuation, not a list or a table, not machine-tokenized."""
    if not text or len(_TOKENIZED.findall(text)) > 2:
        return False
    lines = text.splitlines()
    if sum(line.lstrip().startswith(("-", "*", "|")) for line in lines) > len(lines) // 2:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) > 0.85 and text.count(".") + text.count("!") + text.count("?") >= 2


def trim_words(text: str, max_words: int) -> str:
    """At most ``max_words`` words, cut after the last whole sentence that fits (else at the word)."""
    if len(words(text)) <= max_words:
        return text
    kept, count = [], 0
    for sentence in split_sentences(text):
        n = len(words(sentence))
        if count + n > max_words:
            break
        kept.append(sentence)
        count += n
    if count >= max_words // 2:
        return " ".join(kept)
    return " ".join(words(text)[:max_words]) + " ..."


def split_sentences(text: str) -> list[str]:
    """Sentences, not split after an initial or a common abbreviation (``J. R. Simplot``, ``Dr. No``)."""
    out: list[str] = []
    for part in _SENTENCE_END.split(text.replace("\n", " ")):
        part = part.strip()
        if not part:
            continue
        if out and _ABBREVIATION.search(out[-1]):
            out[-1] += " " + part
        else:
            out.append(part)
    return out


def blocks(prompt: str) -> list[str]:
    return [b.strip() for b in re.split(r"\n\s*\n", prompt) if b.strip()]


def _strip_frame(text: str) -> str:
    """Drop template sentences at either end of a passage (up to three at the start, two at the end)."""
    sentences = split_sentences(text)
    for _ in range(3):
        if len(sentences) > 1 and _BOILERPLATE.search(sentences[0]) and len(words(sentences[0])) < 45:
            sentences = sentences[1:]
    for _ in range(2):
        last = sentences[-1] if sentences else ""
        if len(sentences) > 1 and (
            (_BOILERPLATE.search(last) and len(words(last)) < 45) or not re.search(r"[.!\"')\]]$", last)
        ):
            sentences = sentences[:-1]
    return " ".join(sentences) if len(sentences) != len(split_sentences(text)) else text


def passage_of(prompt: str) -> str | None:
    """The longest prose block of a prompt (40+ words), with the template's lines and lead-ins removed."""
    quoted = (
        re.search(r'is in "(.+)"\. Can you tell me', prompt, re.S)
        or re.search(r'for the passage "(.+)"\?\s*$', prompt, re.S)
        or re.search(
            r"(?:using|inside|in|from) the (?:article|text|context|paragraph|passage)(?: below)?: (.+)$", prompt, re.S
        )
    )
    best = None
    for block in [quoted.group(1)] if quoted else blocks(prompt):
        lines = []
        for line in block.splitlines():
            line = line.strip()
            if not line or _TEMPLATE_LINE.match(line):
                continue
            if len(words(line)) < 30 and (_BOILERPLATE.search(line) or line.endswith("?")):
                continue
            if not lines and (len(words(line)) < 6 or (len(words(line)) < 12 and line[-1] not in ".!?\"'")):
                continue  # a label before the passage (an answer, a title)
            lines.append(_LEAD_IN.sub("", line, count=1))
        text = clean("\n".join(lines)).replace(" quot;", '"').replace("#39;", "'")
        if "\\" in text:
            continue
        if len(_TOKENIZED.findall(text)) > 2:
            text = detokenize(text)
        if len(words(text)) < 40 or re.search(r"\(A\).*\(B\)", text, re.S):
            continue
        if sum(bool(_SPEAKER.match(line)) for line in text.splitlines()) >= 2:
            continue  # a dialogue (`dialogue_of`), not prose
        text = clean(_strip_frame(text))
        if len(words(text)) >= 40 and text[0].isupper() and is_prose(text) and (best is None or len(text) > len(best)):
            best = text
    return best


def question_of(prompt: str, passage: str | None) -> str | None:
    """A question the prompt asks: ``Question: ...`` / ``Q: ...``, else a line (or its end) ending in ``?``."""
    labelled = [m.group(1) for m in re.finditer(r"^(?:Question|Q)\s*:\s*(.+?)\s*$", prompt, re.MULTILINE)]
    lines = [line.strip() for line in prompt.splitlines() if line.strip().endswith(("?", '?"'))]
    for candidate in labelled + [part for line in lines for part in (line, line.rsplit(": ", 1)[-1])]:
        question = detokenize(candidate.strip().strip('"').strip()).split("?,")[0]
        question = re.sub(r"^[\w ,']{0,40}\bquestion\b[\w ,']{0,12}:\s*", "", question)
        question = question if question.endswith("?") else question + "?" if "?," in candidate else question
        if (
            question.endswith("?")
            and 4 <= len(words(question)) <= 35
            and question[0].isalpha()
            and not _BOILERPLATE.search(question)
            and not _SPEAKER.match(question)
            and (passage is None or question[:-1] not in passage)
        ):
            return question[0].upper() + question[1:]
    return None


def dialogue_of(prompt: str) -> str | None:
    """The longest run of ``Name: text`` lines (blank lines between them allowed), 3+ turns, 2+ speakers."""
    lines = [line.strip() for line in prompt.splitlines() if line.strip()]
    if lines:  # "Summarize: Julia: Adam, are you coming?" -> "Julia: Adam, are you coming?"
        first = re.match(r"^([^:]{1,40}):\s+(.*)$", lines[0])
        if first and _SPEAKER.match(first.group(2)) and first.group(1) not in _speakers(lines):
            lines[0] = first.group(2)
    best: list[str] = []
    run: list[str] = []
    for line in [*lines, ""]:
        match = _SPEAKER.match(line)
        if match and match.group(1) not in _NOT_SPEAKERS:
            run.append(f"{match.group(1)}: {match.group(2)}")
            continue
        if len(run) > len(best):
            best = run
        run = []
    speakers = {line.split(":", 1)[0] for line in best}
    if len(best) >= 3 and len(speakers) >= 2:
        return "\n".join(best)
    return None


def _speakers(lines: Sequence[str]) -> list[str]:
    names = []
    for line in lines[1:]:
        match = _SPEAKER.match(line)
        if match:
            names.append(match.group(1))
    return names


def sentences_of(passage: str) -> list[str]:
    """Stand-alone sentences: 8-32 words, a capital first, a full stop last, balanced quotes, no list marks."""
    out = []
    for sentence in split_sentences(passage):
        n = len(words(sentence))
        if (
            8 <= n <= 32
            and sentence[0].isupper()
            and sentence.endswith((".", "!", "?"))
            and sentence.count('"') % 2 == 0
            and sentence.count("(") == sentence.count(")")
            and not re.search(r"https?:|@|#|\|| - |\s[A-Z]{4,}\s", sentence)
        ):
            out.append(sentence)
    return out


def _first_match(pattern: str, text: str, flags: int = 0) -> str | None:
    match = re.search(pattern, text, flags)
    return match.group(1).strip() if match else None


def parse_material(prompts: Iterable[dict]) -> Material:
    """Parse every prompt; duplicates (same text, whatever the template) are kept once."""
    fields: dict[str, list] = {field.name: [] for field in attrs.fields(Material)}
    seen: dict[tuple[str, str], None] = {}

    def add(field: str, item) -> None:
        text = item.question if isinstance(item, QAPair) else item.text
        key = (field, re.sub(r"\W+", " ", text.lower()).strip()[:200])
        if key not in seen:
            seen[key] = None
            fields[field].append(item)

    for row in prompts:
        prompt, source = row["prompt"], row.get("source", "")
        if source.startswith("gsm8k"):
            add("problems", Piece(clean(prompt), source))
            continue
        if source.startswith("self_instruct"):
            first = blocks(prompt)[0]
            if len(words(first)) <= 60:
                add("instructions", Piece(clean(first), source))
        passage = passage_of(prompt) if source.split(":", 1)[-1].startswith(PASSAGE_SOURCES) else None
        if passage is not None:
            add("passages", Piece(passage, source))
            for sentence in sentences_of(passage):
                add("sentences", Piece(sentence, source))
        question = question_of(prompt, passage)
        if question is not None and passage is not None:
            add("qa", QAPair(passage, question, source))
        dialogue = dialogue_of(prompt)
        if dialogue is not None:
            add("dialogues", Piece(dialogue, source))
        _standalone(prompt, source, passage, add)
    return Material(**fields)


def _standalone(prompt: str, source: str, passage: str | None, add) -> None:
    """Questions, topics, titles and facts, read from the templates that carry them."""
    name = source.split(":", 1)[-1]
    lines = [line.strip() for line in prompt.splitlines() if line.strip()]
    if name.startswith("trec") and lines:
        question = next((line for line in lines if line.endswith("?") and not _BOILERPLATE.search(line)), None)
        if question:
            question = re.sub(r"^Question: ", "", detokenize(question).replace(" ?", "?"))
            add("questions", Piece(question, source))
    elif name.startswith("kilt_tasks_hotpotqa") and len(lines) == 1 and lines[0].endswith("?"):
        add("questions", Piece(re.sub(r"^[^:?\"]{0,60}:\s*", "", lines[0]), source))  # "Combine facts and answer this:"
    elif name.startswith("commonsense_qa_answer_given_question_without_options") and len(lines) >= 2:
        add("questions", Piece(lines[1], source))
    elif name.startswith("sciq") and "Closed_Book" in name:
        question = _first_match(r"^Q:\s*(.+)$", prompt, re.MULTILINE)
        if question and question.endswith("?"):
            add("questions", Piece(question, source))
    elif name.startswith("sciq"):
        support = passage_of(prompt) or (blocks(prompt)[1] if len(blocks(prompt)) > 2 else None)
        if support and 8 <= len(words(support)) <= 60 and "?" not in support and not support.startswith("Q:"):
            add("facts", Piece(clean(support), source))
    if name.startswith("common_gen"):
        concepts = _first_match(r"(?:sentence|concepts)\s*:\s*([a-z]+(?:, [a-z]+){2,5})\.?\s*$", prompt, re.I | re.M)
        if concepts is None:
            concepts = _first_match(r"about the topic ([a-z]+)\?", prompt, re.I)
        if concepts:
            add("concepts", Piece(concepts.lower(), source))
    elif name.startswith("qasc"):
        first = re.sub(r"^If I tell you that ", "", lines[0]).split(", and ask you")[0].split(". Given")[0]
        for fact in re.findall(r"Fact \d: (.+?)(?:\n|$)", prompt) or re.split(r", and ", first):
            fact = fact.strip().rstrip(".")
            if 5 <= len(words(fact)) <= 30 and '"' not in fact and "question" not in fact:
                add("facts", Piece(fact[0].upper() + fact[1:] + ".", source))
    elif name.startswith("wiqa") and sum(line.startswith("-") for line in lines) >= 3:
        steps = [line.lstrip("- ").strip() for line in lines if line.startswith("-")]
        add("facts", Piece("\n".join(f"- {s}" for s in steps), source))
    title = None
    if name.startswith("ag_news") and lines:
        title = _first_match(r"^(.{10,90}?) \((?:AP|Reuters|AFP|SPACE\.com|[A-Za-z.]{2,20})\)", lines[0])
    elif name.startswith("dbpedia"):
        title = _first_match(r"(?:\.|^) ?([A-Z][^.\n]{2,60}?) -  ", prompt)
    elif "Review title:" in prompt:
        title = _first_match(r"Review title: (.+)", prompt)
    elif "Movie plot title:" in prompt or "Movie title:" in prompt:
        title = _first_match(r"Movie (?:plot )?title: (.+)", prompt)
    elif name.startswith("gigaword") and lines and not passage:
        sentence = detokenize(re.sub(r"^[^:]{0,40}: ", "", lines[0]))  # "Make a title for this article: ..."
        sentence = sentence[: sentence.rfind(".") + 1] or sentence  # "... abkhazia. In a nutshell,"
        if 8 <= len(words(sentence)) <= 40 and "#" not in sentence:
            add("topics", Piece(sentence[0].upper() + sentence[1:], source))
    if title and 2 <= len(words(title)) <= 14:
        add("topics", Piece(title.strip(" .:"), source))
