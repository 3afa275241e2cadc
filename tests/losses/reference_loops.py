"""Every loss written with explicit Python loops over positions and classes, straight from the
spec's formulas (../shared/spec/del-loss.md). Independent of the vectorized code: no shared
helpers, no tensors in the math, only `math` on Python floats (float64)."""

from __future__ import annotations

import math

POINT = "."


def token_kinds(labels, digit_ids, point_ids, ignore_index, mask):
    """Per position: a digit value 0..9, '.', None (other), or 'masked'."""
    out = []
    for t, label in enumerate(labels):
        if label == ignore_index or (mask is not None and mask[t] == 0):
            out.append("masked")
            continue
        kind = None
        for k, ids in enumerate(digit_ids):
            if label in ids:
                kind = k
        if label in point_ids:
            kind = POINT
        out.append(kind)
    return out


def scan_places(kinds):
    """Left-to-right scan: place of each digit, and which '.' are decimal points (the grouped
    scan below on one-digit strings)."""
    strings = [str(k) if isinstance(k, int) else k for k in kinds]
    places, decimal_points = scan_grouped_places(strings)
    return [None if p is None else p[0] for p in places], decimal_points


def weight(place, slope, base):
    return slope * (place + 1) if place >= 0 else base ** (place - 1)


def logsumexp(values):
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def softmax(values):
    m = max(values)
    e = [math.exp(v - m) for v in values]
    s = sum(e)
    return [x / s for x in e]


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def loop_loss(logits, labels, digit_ids, point_ids, cfg, vocab_size, mask=None, cost=None):
    """logits: [B][S][V] floats; labels [B][S]; returns (loss, ce, numeric, n_tokens, n_digits)."""
    alpha = cfg["alpha"]
    kind = cfg["kind"]
    classes = [list(ids) for ids in digit_ids] + ([list(point_ids)] if cfg["point_class"] else [])
    num_classes = len(classes)
    ce_terms, mix_terms, emo_terms, numeric_terms = [], [], [], []
    for b in range(len(labels)):
        kinds = token_kinds(
            labels[b], digit_ids, point_ids, cfg["ignore_index"], None if mask is None else mask[b]
        )
        places, decimal_points = scan_places(kinds)
        for t, label in enumerate(labels[b]):
            if kinds[t] == "masked":
                continue
            z = logits[b][t][:vocab_size]
            ce_t = logsumexp(z) - z[label]
            ce_terms.append(ce_t)
            mix_terms.append((cfg["eta"] + (1 - cfg["eta"]) * math.exp(-ce_t)) * ce_t)
            if cost is not None:
                q = softmax(z)
                expected = [
                    sum(q[v] * cost[v][h] for v in range(vocab_size)) for h in range(len(cost[0]))
                ]
                emo_terms.append(
                    1 - sum(cost[label][h] * expected[h] for h in range(len(expected)))
                )
            if isinstance(kinds[t], int):
                target = kinds[t]
                u = weight(places[t], cfg["slope"], cfg["base"]) if cfg["place_weighting"] else 1.0
            elif kinds[t] == POINT and decimal_points[t] and cfg["point_class"]:
                target, u = 10, 1.0
            else:
                continue
            zc = [logsumexp([z[i] for i in ids]) for ids in classes]
            p = softmax(zc)
            if kind in ("del", "del_distance"):
                centre = sum(zc) / num_classes if cfg.get("shift_invariant") else 0.0
                total = 0.0
                for k in range(num_classes):
                    y = 1.0 if k == target else 0.0
                    x = zc[k] - centre
                    bce = -(y * log_sigmoid(x) + (1 - y) * log_sigmoid(-x))
                    term = p[k] * bce
                    if kind == "del_distance":
                        term *= abs(k - target)
                    total += term
                ell = total / num_classes
            elif kind == "ntl_was":
                ell = sum(p[k] * abs(k - target) for k in range(num_classes))
            elif kind == "ntl_mse":
                ell = (sum(p[k] * k for k in range(num_classes)) - target) ** 2
            elif kind == "dist2":
                q_raw = [math.exp(-((k - target) ** 2) / cfg["tau"]) for k in range(num_classes)]
                q = [x / sum(q_raw) for x in q_raw]
                ell = sum(
                    q[k] * (math.log(q[k]) - math.log(p[k])) for k in range(num_classes) if q[k] > 0
                )
            else:
                ell = 0.0
            numeric_terms.append(u * ell)
    n_tok, n_dig = len(ce_terms), len(numeric_terms)
    ce = sum(ce_terms) / max(n_tok, 1)
    if kind == "mixce":
        return sum(mix_terms) / max(n_tok, 1), ce, 0.0, n_tok, n_dig
    if kind == "emo":
        ratio = sum(ce_terms) / sum(emo_terms)
        loss = sum(0.5 * (c + ratio * e) for c, e in zip(ce_terms, emo_terms, strict=True))
        return loss / max(n_tok, 1), ce, sum(emo_terms) / max(n_tok, 1), n_tok, n_dig
    if kind == "mle":
        return ce, ce, 0.0, n_tok, n_dig
    denominator = n_dig if cfg["normalize"] == "digits" else n_tok
    numeric = sum(numeric_terms) / max(denominator, 1)
    return ce + alpha * numeric, ce, numeric, n_tok, n_dig


# ---- grouped digits (number tokens of 1..m digits, docs/losses.md) ----------------------


def grouped_kinds(labels, strings, point_ids, ignore_index, mask):
    """Per position: the target's digit string, '.', None (other), or 'masked'."""
    out = []
    for t, label in enumerate(labels):
        if label == ignore_index or (mask is not None and mask[t] == 0):
            out.append("masked")
        elif label in strings:
            out.append(strings[label])
        elif label in point_ids:
            out.append(POINT)
        else:
            out.append(None)
    return out


def scan_grouped_places(kinds):
    """Left-to-right scan: per position, the places of its token's digits (a list; None off
    numbers), and which '.' are decimal points. kinds: digit strings, '.', None, 'masked'."""
    n = len(kinds)

    def is_number(t):
        return 0 <= t < n and kinds[t] not in (None, POINT, "masked")

    places = [None] * n
    decimal_points = [False] * n

    def read_decimals(t):
        seen = 0
        while is_number(t):
            places[t] = [-(seen + j + 1) for j in range(len(kinds[t]))]
            seen += len(kinds[t])
            t += 1
        if t < n and kinds[t] == POINT:  # a second '.' ends the number and starts nothing
            t += 1
        return t

    t = 0
    while t < n:
        if is_number(t):
            start = t
            while is_number(t):
                t += 1
            remaining = sum(len(kinds[i]) for i in range(start, t))
            for i in range(start, t):
                places[i] = [remaining - 1 - j for j in range(len(kinds[i]))]
                remaining -= len(kinds[i])
            if t < n and kinds[t] == POINT and is_number(t + 1):
                decimal_points[t] = True
                t = read_decimals(t + 1)
            continue
        if kinds[t] == POINT and is_number(t + 1) and not is_number(t - 1):
            decimal_points[t] = True
            t = read_decimals(t + 1)
            continue
        t += 1
    return places, decimal_points


def digit_term(kind, zc, target, tau):
    """l of one digit slot: class logits zc (ten floats), target digit."""
    p = softmax(zc)
    if kind in ("del", "del_distance"):
        total = 0.0
        for k in range(10):
            y = 1.0 if k == target else 0.0
            term = p[k] * -(y * log_sigmoid(zc[k]) + (1 - y) * log_sigmoid(-zc[k]))
            if kind == "del_distance":
                term *= abs(k - target)
            total += term
        return total / 10
    if kind == "ntl_was":
        return sum(p[k] * abs(k - target) for k in range(10))
    if kind == "ntl_mse":
        return (sum(p[k] * k for k in range(10)) - target) ** 2
    if kind == "dist2":
        q_raw = [math.exp(-((k - target) ** 2) / tau) for k in range(10)]
        q = [x / sum(q_raw) for x in q_raw]
        return sum(q[k] * (math.log(q[k]) - math.log(p[k])) for k in range(10))
    return 0.0


def grouped_loop_loss(logits, labels, strings, point_ids, cfg, vocab_size, mask=None):
    """The grouped definition with loops. strings: token id -> its digit string (every number
    token, single digits included). Returns (loss, ce, numeric, n_tokens, n_digits)."""
    kind = cfg["kind"]
    ce_terms, numeric_terms = [], []
    for b in range(len(labels)):
        kinds = grouped_kinds(
            labels[b], strings, point_ids, cfg["ignore_index"], None if mask is None else mask[b]
        )
        places, _ = scan_grouped_places(kinds)
        for t, label in enumerate(labels[b]):
            if kinds[t] == "masked":
                continue
            z = logits[b][t][:vocab_size]
            ce_terms.append(logsumexp(z) - z[label])
            if kinds[t] in (None, POINT):
                continue
            text = kinds[t]
            for j, digit in enumerate(text):
                zc = [
                    logsumexp(
                        [z[c] for c, s in strings.items() if len(s) == len(text) and s[j] == str(d)]
                    )
                    for d in range(10)
                ]
                place = places[t][j]
                u = weight(place, cfg["slope"], cfg["base"]) if cfg["place_weighting"] else 1.0
                numeric_terms.append(u * digit_term(kind, zc, int(digit), cfg["tau"]))
    n_tok, n_dig = len(ce_terms), len(numeric_terms)
    ce = sum(ce_terms) / max(n_tok, 1)
    if kind == "mle":
        return ce, ce, 0.0, n_tok, n_dig
    denominator = n_dig if cfg["normalize"] == "digits" else n_tok
    numeric = sum(numeric_terms) / max(denominator, 1)
    return ce + cfg["alpha"] * numeric, ce, numeric, n_tok, n_dig
