/* A small Markdown renderer for the chat page.
 *
 * Safety: every piece of source text is HTML-escaped before any markup is added, code is
 * escaped verbatim, and links are kept only for http(s) and mailto URLs. The result is
 * therefore safe to assign to innerHTML whatever the model writes.
 *
 * Supported: fenced code blocks (``` or ~~~, with a language; an unclosed fence runs to the
 * end, which is what a streamed answer looks like mid-block), headings, paragraphs, hard line
 * breaks, bullet and numbered lists (nested by indentation), block quotes, horizontal rules,
 * GitHub-style tables, `inline code`, **bold**, *italic*, ~~strike~~ and [links](https://...).
 */
(function (global) {
  "use strict";

  var HOLE = "\u0000"; // marks stashed inline fragments; stripped from the input first

  function escapeHtml(s) {
    return String(s)
      .replace(/&/g, "&amp;")
      .replace(/</g, "&lt;")
      .replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;")
      .replace(/'/g, "&#39;");
  }

  // `url` is already escaped; only absolute http(s) and mailto links become anchors.
  function safeUrl(url) {
    return /^(https?:\/\/|mailto:)[^\s]+$/i.test(url);
  }

  function inline(raw) {
    var stash = [];
    function keep(html) {
      stash.push(html);
      return HOLE + (stash.length - 1) + HOLE;
    }
    // Code spans first, from the raw text, so nothing inside them is interpreted.
    var s = raw.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, function (_, ticks, code) {
      return keep("<code>" + escapeHtml(code.replace(/^ (.*) $/, "$1")) + "</code>");
    });
    s = escapeHtml(s);
    s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, function (m, label, url) {
      if (!safeUrl(url)) return m;
      return keep('<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + emphasis(label) + "</a>");
    });
    s = emphasis(s);
    s = s.replace(/ {2,}\n|\\\n|\n/g, "<br>");
    return s.replace(new RegExp(HOLE + "(\\d+)" + HOLE, "g"), function (_, i) {
      return stash[+i];
    });
  }

  function emphasis(s) {
    return s
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?![_\w])/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  }

  var RE = {
    fence: /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/,
    heading: /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/,
    hr: /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/,
    quote: /^ {0,3}> ?/,
    item: /^(\s*)([-*+]|\d{1,9}[.)])(\s+|$)(.*)$/,
    tableSep: /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/,
    blank: /^\s*$/,
  };

  function indentOf(line) {
    var m = /^(\s*)/.exec(line.replace(/\t/g, "    "));
    return m[1].length;
  }

  function startsBlock(lines, i) {
    var line = lines[i];
    return (
      RE.fence.test(line) ||
      RE.heading.test(line) ||
      RE.hr.test(line) ||
      RE.quote.test(line) ||
      RE.item.test(line) ||
      isTableStart(lines, i)
    );
  }

  function isTableStart(lines, i) {
    return (
      i + 1 < lines.length &&
      lines[i].indexOf("|") >= 0 &&
      lines[i + 1].indexOf("-") >= 0 &&
      RE.tableSep.test(lines[i + 1])
    );
  }

  function splitRow(line) {
    var s = line.trim();
    if (s.charAt(0) === "|") s = s.slice(1);
    if (s.charAt(s.length - 1) === "|" && s.charAt(s.length - 2) !== "\\") s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map(function (c) {
      return c.trim().replace(/\\\|/g, "|");
    });
  }

  function codeBlock(lang, code) {
    var cls = lang ? ' class="language-' + escapeHtml(lang) + '"' : "";
    return (
      '<div class="code-block"><div class="code-head"><span class="code-lang">' +
      escapeHtml(lang || "code") +
      '</span><button type="button" class="copy" aria-label="Copy code">Copy</button></div>' +
      "<pre><code" + cls + ">" + escapeHtml(code) + "</code></pre></div>"
    );
  }

  function blocks(lines) {
    var out = [];
    var i = 0;
    var m;
    while (i < lines.length) {
      var line = lines[i];
      if (RE.blank.test(line)) {
        i++;
        continue;
      }
      // Fenced code.
      if ((m = RE.fence.exec(line))) {
        var fence = m[1];
        var lang = m[2].replace(/[^\w+#.-]/g, "").slice(0, 32);
        var closing = new RegExp("^ {0,3}" + fence.charAt(0) + "{" + fence.length + ",}\\s*$");
        var code = [];
        i++;
        while (i < lines.length && !closing.test(lines[i])) code.push(lines[i++]);
        i++; // the closing fence (or past the end)
        out.push(codeBlock(lang, code.join("\n")));
        continue;
      }
      if ((m = RE.heading.exec(line))) {
        var level = Math.min(6, m[1].length + 2); // the page itself owns h1/h2
        out.push("<h" + level + ">" + inline(m[2] || "") + "</h" + level + ">");
        i++;
        continue;
      }
      if (RE.hr.test(line)) {
        out.push("<hr>");
        i++;
        continue;
      }
      if (RE.quote.test(line)) {
        var quoted = [];
        while (i < lines.length && !RE.blank.test(lines[i]) && (RE.quote.test(lines[i]) || quoted.length)) {
          if (!RE.quote.test(lines[i]) && startsBlock(lines, i)) break;
          quoted.push(lines[i].replace(RE.quote, ""));
          i++;
        }
        out.push("<blockquote>" + blocks(quoted) + "</blockquote>");
        continue;
      }
      if (isTableStart(lines, i)) {
        var head = splitRow(lines[i]);
        var aligns = splitRow(lines[i + 1]).map(function (c) {
          var l = c.charAt(0) === ":";
          var r = c.charAt(c.length - 1) === ":";
          return l && r ? "center" : r ? "right" : l ? "left" : "";
        });
        var cell = function (tag, text, k) {
          var a = aligns[k] ? ' class="align-' + aligns[k] + '"' : "";
          return "<" + tag + a + ">" + inline(text || "") + "</" + tag + ">";
        };
        var html = '<div class="table-wrap"><table><thead><tr>';
        head.forEach(function (c, k) {
          html += cell("th", c, k);
        });
        html += "</tr></thead><tbody>";
        i += 2;
        while (i < lines.length && !RE.blank.test(lines[i]) && lines[i].indexOf("|") >= 0) {
          var row = splitRow(lines[i]);
          html += "<tr>";
          for (var k = 0; k < head.length; k++) html += cell("td", row[k], k);
          html += "</tr>";
          i++;
        }
        out.push(html + "</tbody></table></div>");
        continue;
      }
      if ((m = RE.item.exec(line))) {
        var res = list(lines, i);
        out.push(res.html);
        i = res.next;
        continue;
      }
      // Paragraph: up to a blank line or the start of another block.
      var para = [line.replace(/^\s+/, "")];
      i++;
      while (i < lines.length && !RE.blank.test(lines[i]) && !startsBlock(lines, i)) {
        para.push(lines[i].replace(/^\s+/, ""));
        i++;
      }
      out.push("<p>" + inline(para.join("\n")) + "</p>");
    }
    return out.join("");
  }

  function list(lines, i) {
    var first = RE.item.exec(lines[i]);
    var baseIndent = indentOf(lines[i]);
    var ordered = /\d/.test(first[2]);
    var start = ordered ? parseInt(first[2], 10) : 1;
    var items = [];
    var loose = false;
    while (i < lines.length) {
      var m = RE.item.exec(lines[i]);
      if (!m || indentOf(lines[i]) !== baseIndent || /\d/.test(m[2]) !== ordered) break;
      var contentIndent = indentOf(lines[i]) + m[2].length + Math.max(1, Math.min(m[3].length, 4));
      var body = [m[4]];
      i++;
      while (i < lines.length) {
        var line = lines[i];
        if (RE.blank.test(line)) {
          // A blank line continues the item only if indented content follows.
          var j = i;
          while (j < lines.length && RE.blank.test(lines[j])) j++;
          if (j < lines.length && indentOf(lines[j]) > baseIndent) {
            for (; i < j; i++) body.push("");
            loose = true;
            continue;
          }
          break;
        }
        var ind = indentOf(line);
        if (ind <= baseIndent && (RE.item.test(line) || startsBlock(lines, i))) break;
        if (ind > baseIndent) {
          body.push(line.replace(/\t/g, "    ").slice(Math.min(ind, contentIndent)));
        } else {
          body.push(line.trim()); // lazy continuation of the item's paragraph
        }
        i++;
      }
      items.push(body);
      // A blank line between items makes the list loose; it still ends at two blanks.
      if (i < lines.length && RE.blank.test(lines[i])) {
        var k = i;
        while (k < lines.length && RE.blank.test(lines[k])) k++;
        var nm = k < lines.length ? RE.item.exec(lines[k]) : null;
        if (nm && indentOf(lines[k]) === baseIndent && /\d/.test(nm[2]) === ordered) {
          loose = true;
          i = k;
        }
      }
    }
    var tag = ordered ? "ol" : "ul";
    var html = "<" + tag + (ordered && start !== 1 ? ' start="' + start + '"' : "") + ">";
    items.forEach(function (body) {
      var inner = blocks(body);
      if (!loose) inner = inner.replace(/^<p>([\s\S]*?)<\/p>/, "$1");
      html += "<li>" + inner + "</li>";
    });
    return { html: html + "</" + tag + ">", next: i };
  }

  function render(src) {
    var text = String(src == null ? "" : src)
      .replace(/\r\n?/g, "\n")
      .split(HOLE)
      .join("");
    return blocks(text.split("\n"));
  }

  global.kvshipMarkdown = { render: render, escapeHtml: escapeHtml };
})(window);
