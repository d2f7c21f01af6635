// Baton's chat page: plain JavaScript, no build step. Talks to the same OpenAI-compatible API as any
// client: GET /v1/models, /v1/conversations (list, create, open, delete) and a streamed
// POST /v1/chat/completions with `conversation_id`, read with fetch + ReadableStream (SSE by hand:
// EventSource cannot POST). Text is inserted with textContent only, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "baton.apiKey";
const state = { key: "", model: null, conversation: null, controller: null };

function headers() {
  return { "Authorization": `Bearer ${state.key}`, "Content-Type": "application/json" };
}

async function apiError(response) {
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  const error = new Error(message);
  error.status = response.status;
  return error;
}

async function api(method, path, body) {
  const response = await fetch(path, {
    method, headers: headers(), body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) throw await apiError(response);
  return response.json();
}

function setStatus(text) { $("status").textContent = text; }

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.dataset.role = role;
  div.setAttribute("data-testid", "message");
  div.textContent = text;
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function useKey(key) {
  state.key = key.trim();
  localStorage.setItem(KEY_STORAGE, state.key);
  try {
    const models = await api("GET", "/v1/models");
    state.model = models.data[0];
    $("model").textContent = `${state.model.id} · ${state.model.context_window} tokens`;
    await refreshConversations();
    setStatus("Ready.");
  } catch (error) {
    state.model = null;
    setStatus(`Key not accepted: ${error.message}`);
  }
}

async function refreshConversations() {
  const list = (await api("GET", "/v1/conversations")).data;
  const items = list.map((conversation) => {
    const li = document.createElement("li");
    li.dataset.id = conversation.id;
    li.setAttribute("data-testid", "conversation");
    if (conversation.id === state.conversation) li.classList.add("active");
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    open.textContent = conversation.title || "Untitled";
    open.addEventListener("click", () => openConversation(conversation.id));
    const remove = document.createElement("button");
    remove.className = "delete";
    remove.type = "button";
    remove.title = "Delete";
    remove.setAttribute("data-testid", "delete-conversation");
    remove.textContent = "✕";
    remove.addEventListener("click", () => deleteConversation(conversation.id));
    li.append(open, remove);
    return li;
  });
  $("conversations").replaceChildren(...items);
}

async function openConversation(id) {
  try {
    const conversation = await api("GET", `/v1/conversations/${id}`);
    state.conversation = id;
    $("messages").replaceChildren();
    for (const message of conversation.messages) addMessage(message.role, message.content);
    await refreshConversations();
    setStatus(`Conversation "${conversation.title || "Untitled"}".`);
  } catch (error) {
    setStatus(`Cannot open the conversation: ${error.message}`);
  }
}

async function deleteConversation(id) {
  try {
    await api("DELETE", `/v1/conversations/${id}`);
    if (state.conversation === id) newConversation();
    await refreshConversations();
    setStatus("Conversation deleted.");
  } catch (error) {
    setStatus(`Cannot delete: ${error.message}`);
  }
}

function newConversation() {
  state.conversation = null;
  $("messages").replaceChildren();
  for (const li of $("conversations").children) li.classList.remove("active");
}

// Reads an SSE body: `data:` lines carry JSON chunks; ids, keep-alive comments and blank lines are
// skipped. Returns { finish, refusal } (refusal: the text of any `delta.refusal`, else "").
async function readStream(body, onDelta) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let finish = "unknown";
  let refusal = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return { finish, refusal };
    buffer += value;
    let newline;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, newline).replace(/\r$/, "");
      buffer = buffer.slice(newline + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return { finish, refusal };
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) onDelta(choice.delta.content);
        if (choice.delta && choice.delta.refusal) refusal += choice.delta.refusal;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  }
}

async function send(text) {
  if (!state.model) { setStatus("Enter an API key first."); return; }
  setBusy(true);
  try {
    if (!state.conversation) {
      state.conversation = (await api("POST", "/v1/conversations", { title: text.slice(0, 60) })).id;
    }
    addMessage("user", text);
    const bubble = addMessage("assistant", "");
    state.controller = new AbortController();
    setStatus("Generating...");
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: state.controller.signal,
      body: JSON.stringify({
        model: state.model.id, stream: true, conversation_id: state.conversation,
        messages: [{ role: "user", content: text }],
        max_tokens: Number($("max-tokens").value) || 256, temperature: Number($("temperature").value),
      }),
    });
    if (!response.ok) throw await apiError(response);
    const { finish, refusal } = await readStream(response.body, (delta) => {
      bubble.textContent += delta;
      bubble.scrollIntoView({ block: "end" });
    });
    bubble.dataset.finish = finish;
    if (finish === "content_filter") {
      // A refused prompt has no text at all; a halted answer keeps what was shown before the halt.
      const note = document.createElement("div");
      note.className = "refusal";
      note.textContent = refusal || (bubble.textContent
        ? "The rest of this answer was stopped by the content policy."
        : "Sorry, this request was refused by the content policy.");
      bubble.appendChild(note);
    }
    setStatus(`Done (${finish}).`);
  } catch (error) {
    if (error.name === "AbortError") {
      setStatus("Stopped.");
    } else {
      addMessage("error", error.message);
      setStatus(`Error: ${error.message}`);
    }
  } finally {
    state.controller = null;
    setBusy(false);
    refreshConversations().catch(() => {});
  }
}

function init() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    useKey($("api-key").value);
  });
  $("new-chat").addEventListener("click", newConversation);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  const saved = localStorage.getItem(KEY_STORAGE);
  if (saved) {
    $("api-key").value = saved;
    useKey(saved);
  }
}

init();
