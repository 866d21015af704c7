/* The kvship chat page: talks to the OpenAI-compatible API of the server that serves it.
 * Streams answers from POST /v1/chat/completions (Server-Sent Events), renders them as
 * Markdown (markdown.js escapes first), and aborts the request when Stop is pressed. */
(function () {
  "use strict";

  var md = window.kvshipMarkdown;
  var $ = function (id) {
    return document.getElementById(id);
  };
  var els = {
    model: $("model-name"),
    keyButton: $("key-button"),
    newChat: $("new-chat"),
    system: $("system-prompt"),
    temperature: $("temperature"),
    temperatureValue: $("temperature-value"),
    maxTokens: $("max-tokens"),
    contextHint: $("context-hint"),
    messages: $("messages"),
    empty: $("empty-note"),
    error: $("error"),
    composer: $("composer"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
    usage: $("usage"),
    keyDialog: $("key-dialog"),
    keyForm: $("key-form"),
    keyReason: $("key-reason"),
    apiKey: $("api-key"),
  };

  // ---- persistence --------------------------------------------------------------------------
  var store = {
    get: function (name, fallback) {
      try {
        var v = window.localStorage.getItem("kvship." + name);
        return v === null ? fallback : v;
      } catch (e) {
        return fallback;
      }
    },
    set: function (name, value) {
      try {
        if (value === null || value === "") window.localStorage.removeItem("kvship." + name);
        else window.localStorage.setItem("kvship." + name, value);
      } catch (e) {
        /* storage unavailable (private mode): settings just don't persist */
      }
    },
  };

  var state = {
    model: null,
    maxModelLen: null,
    history: [], // {role, content} as sent back to the server
    controller: null, // AbortController of the running request
    retryText: null, // a message to send again once an API key has been given
  };

  // ---- small helpers ------------------------------------------------------------------------
  function authHeaders(extra) {
    var h = extra || {};
    var key = store.get("apiKey", "");
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  async function errorMessage(resp) {
    var text = "";
    try {
      text = await resp.text();
    } catch (e) {
      /* body unreadable */
    }
    var message = "";
    try {
      var j = JSON.parse(text);
      if (j && j.error) message = typeof j.error === "string" ? j.error : j.error.message;
      else if (j && j.detail) message = typeof j.detail === "string" ? j.detail : JSON.stringify(j.detail);
    } catch (e) {
      message = text.trim().slice(0, 500);
    }
    return "Error " + resp.status + (resp.statusText ? " " + resp.statusText : "") + (message ? ": " + message : "");
  }

  function showError(message) {
    els.error.textContent = message;
    els.error.hidden = false;
  }

  function clearError() {
    els.error.textContent = "";
    els.error.hidden = true;
  }

  function setModel(text, status) {
    els.model.textContent = text;
    els.model.dataset.state = status;
  }

  function nearBottom() {
    var m = els.messages;
    return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
  }

  function scrollToEnd() {
    els.messages.scrollTop = els.messages.scrollHeight;
  }

  function fmt(n) {
    return Number(n).toLocaleString("en-US");
  }

  // ---- models -------------------------------------------------------------------------------
  async function loadModels() {
    setModel("loading…", "loading");
    var resp;
    try {
      resp = await fetch("/v1/models", { headers: authHeaders(), cache: "no-store" });
    } catch (e) {
      setModel("server unreachable", "error");
      showError("Could not reach the server: " + e.message);
      return false;
    }
    if (resp.status === 401) {
      setModel("API key needed", "error");
      askForKey(await errorMessage(resp));
      return false;
    }
    if (!resp.ok) {
      setModel("unavailable", "error");
      showError(await errorMessage(resp));
      return false;
    }
    var body = await resp.json();
    var card = body && body.data && body.data[0];
    if (!card) {
      setModel("no model", "error");
      showError("The server lists no model.");
      return false;
    }
    state.model = card.id;
    state.maxModelLen = card.max_model_len || null;
    setModel(card.id, "ready");
    els.model.title = card.id;
    document.title = card.id + " · kvship chat";
    if (state.maxModelLen) {
      els.maxTokens.max = String(state.maxModelLen);
      els.contextHint.textContent = "Context: " + fmt(state.maxModelLen) + " tokens (prompt + answer).";
    }
    clearError();
    return true;
  }

  // ---- API key ------------------------------------------------------------------------------
  function askForKey(reason) {
    els.keyReason.textContent = reason || "Enter the API key this server was started with (--api-key).";
    els.apiKey.value = store.get("apiKey", "");
    if (!els.keyDialog.open) els.keyDialog.showModal();
    els.apiKey.focus();
    els.apiKey.select();
  }

  els.keyForm.addEventListener("submit", function (e) {
    e.preventDefault();
    var action = (e.submitter && e.submitter.value) || "save";
    els.keyDialog.close(action);
  });

  els.keyDialog.addEventListener("close", async function () {
    var action = els.keyDialog.returnValue;
    if (action === "save") store.set("apiKey", els.apiKey.value.trim());
    else if (action === "clear") store.set("apiKey", null);
    els.apiKey.value = "";
    if (action !== "save" && action !== "clear") {
      state.retryText = null;
      els.prompt.focus();
      return;
    }
    var ok = await loadModels();
    if (ok && state.retryText) {
      var text = state.retryText;
      state.retryText = null;
      if (els.prompt.value.trim() === text) els.prompt.value = "";
      send(text);
    } else {
      els.prompt.focus();
    }
  });

  els.keyButton.addEventListener("click", function () {
    askForKey("Enter the API key this server was started with (--api-key), or forget the stored one.");
  });

  // ---- conversation view --------------------------------------------------------------------
  function addMessage(role) {
    els.empty.hidden = true;
    var root = document.createElement("article");
    root.className = "msg msg-" + role;
    var who = document.createElement("h2");
    who.className = "role";
    who.textContent = role === "user" ? "You" : state.model || "Assistant";
    var body = document.createElement("div");
    body.className = "body";
    var meta = document.createElement("p");
    meta.className = "meta";
    root.append(who, body, meta);
    els.messages.appendChild(root);
    scrollToEnd();
    return { root: root, body: body, meta: meta };
  }

  function renderAssistant(view, text, streaming) {
    var stick = nearBottom();
    view.body.innerHTML = md.render(text) + (streaming ? '<span class="cursor" aria-hidden="true"></span>' : "");
    if (stick) scrollToEnd();
  }

  // Copy buttons of code blocks.
  els.messages.addEventListener("click", function (e) {
    var btn = e.target.closest && e.target.closest("button.copy");
    if (!btn) return;
    var code = btn.closest(".code-block").querySelector("code").textContent;
    var done = function (label) {
      btn.textContent = label;
      setTimeout(function () {
        btn.textContent = "Copy";
      }, 1500);
    };
    if (navigator.clipboard && navigator.clipboard.writeText) {
      navigator.clipboard.writeText(code).then(
        function () {
          done("Copied");
        },
        function () {
          done("Copy failed");
        }
      );
    } else {
      done("Copy failed");
    }
  });

  // ---- streaming ----------------------------------------------------------------------------
  // Reads an SSE body, calling onData(object) for each `data:` event; stops at [DONE].
  async function readEvents(resp, onData) {
    var reader = resp.body.getReader();
    var decoder = new TextDecoder();
    var buf = "";
    var finished = false;
    function handle(raw) {
      var data = raw
        .split(/\r?\n/)
        .filter(function (l) {
          return l.indexOf("data:") === 0;
        })
        .map(function (l) {
          return l.slice(5).replace(/^ /, "");
        })
        .join("\n");
      if (!data) return;
      if (data.trim() === "[DONE]") {
        finished = true;
        return;
      }
      var obj;
      try {
        obj = JSON.parse(data);
      } catch (e) {
        return; // not JSON: ignore, as OpenAI clients do
      }
      onData(obj);
    }
    while (!finished) {
      var r = await reader.read();
      if (r.done) break;
      buf += decoder.decode(r.value, { stream: true });
      var m;
      while (!finished && (m = /\r?\n\r?\n/.exec(buf))) {
        var raw = buf.slice(0, m.index);
        buf = buf.slice(m.index + m[0].length);
        handle(raw);
      }
    }
    if (!finished) {
      buf += decoder.decode();
      if (buf.trim()) handle(buf);
    } else {
      reader.cancel().catch(function () {});
    }
    return finished;
  }

  function requestMessages() {
    var msgs = [];
    var system = els.system.value.trim();
    if (system) msgs.push({ role: "system", content: system });
    state.history.forEach(function (m) {
      if (m.content) msgs.push({ role: m.role, content: m.content });
    });
    return msgs;
  }

  function setBusy(busy) {
    els.send.disabled = busy;
    els.stop.hidden = !busy;
    els.composer.setAttribute("aria-busy", busy ? "true" : "false");
    document.body.dataset.busy = busy ? "true" : "false";
  }

  function usageText(usage, seconds) {
    var s =
      fmt(usage.prompt_tokens) + " prompt + " + fmt(usage.completion_tokens) + " completion = " +
      fmt(usage.total_tokens) + " tokens";
    if (seconds > 0 && usage.completion_tokens > 1) s += " · " + (usage.completion_tokens / seconds).toFixed(1) + " tok/s";
    return s;
  }

  async function send(text) {
    text = (text || "").trim();
    if (!text || state.controller) return;
    clearError();

    var turn = { role: "user", content: text };
    state.history.push(turn);
    var userView = addMessage("user");
    userView.body.textContent = text;

    var answer = { role: "assistant", content: "" };
    var view = addMessage("assistant");
    view.root.setAttribute("aria-busy", "true");
    view.root.dataset.state = "waiting";
    renderAssistant(view, "", true);

    var maxTokens = parseInt(els.maxTokens.value, 10);
    var payload = {
      messages: requestMessages(),
      stream: true,
      stream_options: { include_usage: true },
      temperature: parseFloat(els.temperature.value),
    };
    if (state.model) payload.model = state.model;
    if (maxTokens > 0) payload.max_tokens = maxTokens;

    var controller = new AbortController();
    state.controller = controller;
    setBusy(true);

    var started = performance.now();
    var firstAt = null;
    var lastAt = null;
    var usage = null;
    var finish = null;
    var error = null;
    var stopped = false;
    var pending = false;
    var scheduleRender = function () {
      if (pending) return;
      pending = true;
      requestAnimationFrame(function () {
        pending = false;
        if (state.controller === controller) renderAssistant(view, answer.content, true);
      });
    };

    try {
      var resp = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: authHeaders({ "Content-Type": "application/json", Accept: "text/event-stream" }),
        body: JSON.stringify(payload),
        signal: controller.signal,
      });
      if (resp.status === 401) {
        // Take the turn back, ask for the key, and send it again once one is given.
        var reason = await errorMessage(resp);
        state.history.pop();
        userView.root.remove();
        view.root.remove();
        els.empty.hidden = els.messages.querySelector(".msg") !== null;
        state.retryText = text;
        els.prompt.value = text;
        askForKey(reason);
        return;
      }
      if (!resp.ok) throw new Error(await errorMessage(resp));
      var completed = await readEvents(resp, function (obj) {
        if (obj.error) {
          throw new Error("Error: " + (obj.error.message || JSON.stringify(obj.error)));
        }
        (obj.choices || []).forEach(function (choice) {
          if (choice.index !== 0 && choice.index !== undefined) return;
          var piece = choice.delta && choice.delta.content;
          if (piece) {
            if (firstAt === null) firstAt = performance.now();
            lastAt = performance.now();
            answer.content += piece;
            view.root.dataset.state = "streaming";
            scheduleRender();
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        });
        if (obj.usage) usage = obj.usage;
      });
      if (!completed && !finish) error = "The answer ended early: the connection closed before the server finished.";
    } catch (e) {
      if (e && e.name === "AbortError") stopped = true;
      else error = e instanceof TypeError ? "Could not reach the server: " + e.message : e.message || String(e);
    } finally {
      if (state.controller === controller) {
        state.controller = null;
        setBusy(false);
      }
    }
    if (!view.root.isConnected) return; // taken back (401)

    renderAssistant(view, answer.content, false);
    view.root.removeAttribute("aria-busy");
    var notes = [];
    if (usage) {
      var seconds = firstAt !== null && lastAt !== null ? (lastAt - firstAt) / 1000 : 0;
      var u = usageText(usage, seconds);
      notes.push(u);
      els.usage.textContent = "Last answer: " + u + (firstAt !== null ? " · first token after " + ((firstAt - started) / 1000).toFixed(2) + " s" : "");
    }
    if (stopped) notes.push("stopped");
    else if (finish === "length") notes.push("cut off at the max-tokens limit");
    view.meta.textContent = notes.join(" · ");
    if (error) {
      // Shown in the conversation where it happened (and announced), not twice.
      var p = document.createElement("p");
      p.className = "msg-error";
      p.setAttribute("role", "alert");
      p.textContent = error;
      view.body.appendChild(p);
      scrollToEnd();
    }
    view.root.dataset.state = error ? "error" : stopped ? "stopped" : "done";
    if (answer.content) state.history.push(answer);
    else if (error) state.history.splice(state.history.indexOf(turn), 1); // a failed turn is not resent
    else if (!stopped && !error) view.body.innerHTML = '<p class="muted">(empty answer)</p>';
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  // ---- controls -----------------------------------------------------------------------------
  els.composer.addEventListener("submit", function (e) {
    e.preventDefault();
    if (state.controller) return;
    var text = els.prompt.value;
    if (!text.trim()) return;
    els.prompt.value = "";
    send(text);
  });

  els.prompt.addEventListener("keydown", function (e) {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      if (!state.controller) els.composer.requestSubmit();
    } else if (e.key === "Escape" && state.controller) {
      e.preventDefault();
      stop();
    }
  });

  els.stop.addEventListener("click", function () {
    stop();
    els.prompt.focus();
  });

  els.newChat.addEventListener("click", function () {
    stop();
    state.history = [];
    Array.prototype.slice.call(els.messages.querySelectorAll(".msg")).forEach(function (n) {
      n.remove();
    });
    els.empty.hidden = false;
    els.usage.textContent = "";
    clearError();
    els.prompt.focus();
  });

  // Settings persist in this browser.
  els.system.value = store.get("system", "");
  els.temperature.value = store.get("temperature", els.temperature.value);
  els.maxTokens.value = store.get("maxTokens", els.maxTokens.value);
  els.temperatureValue.textContent = Number(els.temperature.value).toFixed(2);
  els.system.addEventListener("input", function () {
    store.set("system", els.system.value);
  });
  els.temperature.addEventListener("input", function () {
    els.temperatureValue.textContent = Number(els.temperature.value).toFixed(2);
    store.set("temperature", els.temperature.value);
  });
  els.maxTokens.addEventListener("input", function () {
    store.set("maxTokens", els.maxTokens.value);
  });

  setBusy(false);
  loadModels();
  els.prompt.focus();
})();
