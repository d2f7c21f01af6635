"""The pattern tier's rules: regular-expression sources per category, over the `words` view.

The `words` view (see `normalize`) is lower-case ASCII-ish words separated by single spaces, so the
sources here never deal with case, punctuation or leetspeak. Two notations, expanded by `expand`:

* a space means "one optional space": spelled-out obfuscation ("k i l l m y s e l f") is joined
  into one run by the normaliser, and "kill ?my ?self" still matches it;
* `<gapN>` means "up to N whole words in between" (bounded, so matching stays linear).

Rules aim at *intent* (a request for, or a statement of, the harmful thing), not at topic words:
"what is ransomware" and "how do I kill a python process" must pass; "write me ransomware" and
"how do I kill my neighbour" must not. Anything subtler is the classifier tier's job.
"""

from __future__ import annotations

import re

from services.safety.categories import Category

_HOWTO = (r"(?:how (?:do|can|could|would|should|might) (?:i|you|we|one|someone) |how to |best way to "
          r"|easiest way to |ways? to |steps? to |teach me (?:how )?to |show me how to |help me "
          r"|explain how to |tell me how to |i (?:want|need|plan|am going|m going) to |want to "
          r"|going to |gonna |planning to |plan to )")

# --- violence -------------------------------------------------------------------------------------
_MAKE = (r"(?:make|build|assemble|construct|create|cook|brew|synthesi[sz]e|manufacture|produce"
         r"|3d print|rig|prepare|mix up|put together)")
_WEAPON = (r"(?:(?:pipe|nail|car|fertili[sz]er|pressure cooker|dirty|suicide|letter) )?bombs?|explosives?"
           r"|ieds?|detonators?|molotovs?(?: cocktails?)?|grenades?|napalm|nerve (?:agent|gas)|sarin"
           r"|ricin|anthrax|mustard gas|chlorine gas|tatp|semtex|dynamite|(?:gun )?silencers?"
           r"|ghost guns?|untraceable (?:guns?|firearms?)|zip guns?|auto sears?|bioweapons?"
           r"|chemical weapons?|poison gas|thermite charges?")
_TARGET = (r"(?:wife|husband|boyfriend|girlfriend|ex|neighbou?rs?|boss|teachers?|classmates?|coworkers?"
           r"|colleagues?|mom|mother|dad|father|brother|sister|family|roommate|landlord|baby|son"
           r"|daughter|partner|coach|students?|step ?dad|step ?mom|uncle|aunt|grandma|grandpa|cousin)")
_VIOLENCE = [
    _MAKE + r" (?:a |an |some |my own |homemade |a homemade |an improvised |a working |the )?(?:"
    + _WEAPON + ")",
    _HOWTO + r"(?:poison|kill|murder|stab|strangle|shoot|hurt|attack|drown|suffocate|run over) "
    r"(?:my |his |her |their |the |a |our )?" + _TARGET,
    r"(?:kill|murder|poison|hurt|get rid of|dispose of) <gap3>without (?:getting caught|leaving (?:a |any )?"
    r"(?:trace|evidence)|anyone (?:knowing|noticing)|being (?:detected|caught))",
    r"(?:untraceable|undetectable) poisons?|poisons? that (?:can ?t|cannot|won ?t) be (?:detected|traced)",
    r"(?:dispose of|get rid of|hide|dissolve) (?:a |the )?(?:dead )?(?:body|corpse)",
    r"(?:plan|carry out|commit|pull off) (?:a )?(?:mass|school) shooting",
    r"shoot up (?:a |the |my )?(?:school|church|mosque|synagogue|mall|office|concert|club)",
    r"(?:kill|stab|shoot|hurt) as many (?:people|students|kids|children) as",
]

# --- self-harm ------------------------------------------------------------------------------------
_SELF_HARM = [
    r"(?:kill|hang|drown|poison|suffocate|electrocute) my ?self",
    r"shoot my ?self(?! in the foot)",
    r"(?:want to|wanna|going to|gonna|how to|how do i|how can i|ways to|urge to|need to|should i"
    r"|thinking about|plan to|deeper when i) (?:cut|hurt|harm|burn|starve) my ?self",
    r"(?:how (?:do|can|should) i|how to|ways? to|best way to|easiest way to|painless(?:ly)? (?:way )?to"
    r"|i want to|i m going to|i am going to|help me) (?:commit suicide|end my (?:own )?life|end it all"
    r"|kill myself|take my (?:own )?life)",
    r"(?:painless|quick|quickest|easiest|best|surest|fastest|least painful) (?:way|ways|method|methods)"
    r" (?:to|of) (?:die|dying|kill myself|suicide|commit suicide|end my life|end it)",
    r"suicide (?:methods?|techniques?|instructions?|pact)",
    r"how (?:many|much) <gap4>(?:to (?:die|kill myself|kill me|overdose)|would kill me)",
    r"(?:i|i ve|i m|i am) (?:want|wanted|going|planning|ready|decided|about) (?:to )?(?:die|end it all"
    r"|end my life|kill myself)",
    r"(?:don ?t|do not) want to (?:live|be alive|wake up) (?:anymore|any more)",
    r"how to (?:hide|conceal) (?:my )?(?:self harm|cuts|scars|cutting)|pro ana tips|thinspo",
]

# --- sexual content involving minors --------------------------------------------------------------
_MINOR = (r"(?:child|children|kids?|minors?|underage|under age|preteens?|pre teens?|prepubescent"
          r"|toddlers?|little (?:girls?|boys?)|schoolgirls?|schoolboys?|(?:[1-9]|1[0-7]) ?(?:years?|yrs?)"
          r" ?old|(?:[1-9]|1[0-7]) ?yos?|lolis?|shota|jailbait|middle schoolers?|(?:6|7|8)th graders?)")
_SEXUAL = (r"(?:erotic|erotica|porn|porno|pornographic|pornography|nudes?|naked (?:photos?|pics?|pictures?"
           r"|images?|videos?)|nsfw|lewd|explicit (?:story|stories|images?|pics?|content|scenes?|roleplay"
           r"|photos?)|sexual (?:roleplay|story|stories|fantasy|fantasies|scenes?|content|pictures?"
           r"|acts?|encounters?|relationship|images?)|sex (?:scenes?|story|stories|tape)|sexy (?:photos?"
           r"|pics?|story)|have sex with|sex with|molest(?:ing)?|fondl(?:e|ing)|seduc(?:e|ing)"
           r"|undress(?:ing)?|sexually)")
_SEXUAL_MINORS = [
    _SEXUAL + r" <gap5>" + _MINOR,
    _MINOR + r" <gap5>" + _SEXUAL,
    r"(?:how to|how do i|i want to|help me) groom (?:a |the |my )?" + _MINOR,
    r"child (?:porn|pornography|sex abuse material)|csam|cheese pizza links",
]

# --- hate / harassment ----------------------------------------------------------------------------
_GROUP = (r"(?:jews|jewish people|muslims|christians|catholics|hindus|sikhs|blacks|black people|whites"
          r"|white people|asians|asian people|chinese people|mexicans|latinos|hispanics|arabs|africans"
          r"|immigrants|migrants|refugees|gays|gay people|lesbians|homosexuals|trans people"
          r"|transgender people|women|disabled people|the disabled|gypsies|roma|indians|pakistanis"
          r"|jewish|muslim|black|gay|trans)")
_DEHUMANISE = (r"(?:vermin|animals|cockroaches|rats|parasites|subhuman|sub human|inferior|a disease"
               r"|a plague|savages|apes|monkeys|filth|scum|not (?:human|people)|less than human"
               r"|genetically inferior|should (?:all )?(?:die|be (?:exterminated|gassed|killed|wiped out"
               r"|eradicated|shot|hanged|burned|sterili[sz]ed|put in camps))|deserve to die|must be "
               r"(?:exterminated|eradicated|wiped out)|need to be (?:exterminated|eradicated|wiped out"
               r"|gassed))")
_HATE = [
    _GROUP + r" (?:(?:are|r|is) (?:all |just |nothing but |basically |literally |like )?)?" + _DEHUMANISE,
    r"(?:exterminate|eradicate|wipe out|gas|kill all|kill every|ethnically cleanse|get rid of all"
    r"|deport all) (?:the |all |of the )?" + _GROUP,
    r"(?:write|compose|create|generate|give me|tell me|make|draft) (?:me )?(?:a |an |some )?<gap2>"
    r"(?:racist|antisemitic|anti semitic|homophobic|transphobic|sexist|islamophobic|misogynist(?:ic)?"
    r"|bigoted|hateful|white supremacist|nazi) (?:jokes?|rants?|posts?|speech|essay|poem|song"
    r"|tweets?|slogans?|memes?|manifesto|propaganda|content|messages?|comments?)",
    r"kys|kill yourself|go die in a|neck yourself|you should (?:die|kill yourself|be raped)",
    r"(?:write|send|draft|compose) (?:me )?(?:a |an |some )?<gap2>(?:threatening|harassing"
    r"|intimidating|death threat|abusive) (?:message|letter|email|text|dm|note|voicemail)s?",
    r"(?:dox|doxx|doxxing|doxing) (?:my|her|him|this|that|a|the|someone)",
    r"(?:harass|bully|stalk|intimidate|terrori[sz]e) <gap3>(?:until (?:she|he|they)|so (?:that )?"
    r"(?:she|he|they)|into (?:quitting|leaving|killing)|online without)",
]

# --- malware / intrusion --------------------------------------------------------------------------
_MAL = (r"(?:ransomware|keyloggers?|key loggers?|trojans?|rootkits?|botnets?|computer worms?"
        r"|self spreading worms?|viruse?s?(?! (?:scanner|scan|detector|detection|checker|protection|removal"
        r"|definitions?|signatures?))|malware(?! (?:scanner|detector|detection|analysis|removal))"
        r"|remote access trojans?|credential stealers?|info ?stealers?|password stealers?"
        r"|cookie stealers?|token grabbers?|cryptojackers?|spyware|stalkerware|backdoors?|reverse shells?"
        r"|zero day exploits?|droppers?|polymorphic (?:code|malware|virus)|phishing (?:kits?|pages?"
        r"|sites?|emails?|websites?)|ddos (?:tools?|scripts?))")
_MAL_VERB = (r"(?:write|code|program|create|build|develop|make|generate|give me|craft|design|produce"
             r"|deploy|spread|distribute|send|obfuscate|plant|install)")
_OTHER = (r"(?:someone|someone else|somebody|my ex|my wife|my husband|my girlfriend|my boyfriend"
          r"|my neighbou?r|my boss|my coworker|my teacher|his|her|their|a stranger|a celebrity"
          r"|other people|people|a company|the school|my school|the government|a bank|my partner)")
_MALWARE = [
    _MAL_VERB + r" (?:me )?(?:a |an |some |the |my own )?(?:(?:working|functional|simple|basic|python"
    r"|powershell|c|javascript|js|undetectable|fud|new|custom|stealthy|small|real) ){0,3}" + _MAL,
    r"(?:hack|hack into|break into|get into|crack|hijack|take over|spy on|access|read|intercept"
    r"|brute force|bruteforce) (?:in ?to )?" + _OTHER + r"(?: s)? <gap2>(?:accounts?|emails?|phone"
    r"|messages|texts|instagram|facebook|snapchat|whatsapp|gmail|wifi|network|camera|webcam|computer"
    r"|laptop|icloud|passwords?|server|database|website)",
    r"(?:steal|dump|harvest|exfiltrate|grab|sniff|phish) <gap2>(?:passwords|credentials|credit card"
    r" numbers|credit cards|cookies|session tokens|login details|bank details|logins)",
    r"(?:bypass|evade|defeat|get past|sneak past|avoid detection by) <gap1>(?:antivirus|anti virus"
    r"|av detection|edr|windows defender|amsi|antimalware|anti malware)|undetectable by antivirus"
    r"|fud crypter",
    r"ddos (?:a |the |this |someone s |his |her |their )?<gap1>(?:website|server|site|network|ip"
    r"|game server|school)",
    r"(?:perform|do|run|launch|execute|craft) (?:a |an )?sql injection|sql injection payloads? (?:to|for"
    r"|that)",
    r"(?:write|create|build|give me) (?:me )?(?:a |an )?(?:working |weaponi[sz]ed )?exploit (?:for|against"
    r"|targeting) ",
]

RULES: dict[Category, list[str]] = {
    Category.VIOLENCE: _VIOLENCE,
    Category.SELF_HARM: _SELF_HARM,
    Category.SEXUAL_MINORS: _SEXUAL_MINORS,
    Category.HATE: _HATE,
    Category.MALWARE: _MALWARE,
}

_GAP = re.compile(r"<gap(\d)>")


def expand(source: str) -> str:
    """Turn the notation above into a plain regex source (spaces optional, gaps bounded)."""
    optional_spaces = source.replace(" ", " ?")
    # \b: a gap starts at a word start, so the optional space before it cannot glue "make" to a gap
    # word "s" and read "makes homophobic jokes" as "make ... homophobic jokes".
    return _GAP.sub(lambda m: rf"(?:\b\w+ ){{0,{m.group(1)}}}", optional_spaces)


def compile_rules(sources: list[str]) -> re.Pattern[str]:
    """One alternation per category, anchored at word boundaries."""
    return re.compile(r"\b(?:" + "|".join(f"(?:{expand(s)})" for s in sources) + r")\b")
